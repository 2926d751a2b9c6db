"""How K/V rows are stored in the paged pool: cast to a float type, or quantized with a scale.

A pool is kv[layer, K|V, block, offset, kv_head, row]: one row is one token's K (or V) for one KV
head. A float32/float16/bfloat16 row is the head_dim values, cast. An fp8 row is a symmetric
per-token, per-KV-head quantization, its float32 scale stored at the end of the row. An int8 row
is the same per-token, per-KV-head quantization of the row rotated by a Hadamard matrix, with
asymmetric codes (a float16 scale and a float16 offset at the end of the row):

    fp8 row, head_dim 64:    | c0 c1 ... c63 | s0 s1 s2 s3 |       68 bytes (float32: 256, float16: 128)
    scale = max_i |x_i| / 448                code_i = x_i / scale, rounded to e4m3
    value_i = code_i x scale, in float32

    int8 row, head_dim 64:   | c0 c1 ... c63 | s0 s1 | z0 z1 |     68 bytes
                               int8 codes      scale   offset (each float16)
    y = x H                   H: the 64x64 Hadamard matrix / 8, orthogonal and symmetric (H H = I)
    scale = (max_i y_i - min_i y_i) / 255, rounded up to float16
    offset = min_i y_i + 128 x scale, rounded to float16
    code_i = (y_i - offset) / scale, rounded to int8      value = (code x scale + offset) H

NOTE: why rotate. SmolLM2's keys carry a few large, nearly constant channels (a row's largest |x|
is 4-6x its RMS), so a scale set by the largest value leaves few codes for the channels that tell
tokens apart. The rotation spreads every channel over all 64 (max/RMS about 2.5); the asymmetric
codes then use all 256 levels of a row that is not centred. Keys cost far more accuracy than values
(`python -m bench.kv_quant`). A head_dim that is not a power of two is rotated in blocks
of its largest power-of-two divisor.

NOTE: the model attends in the rotated basis, not over value rows: q.k = (qH).(kH), and the output
sum_j p_j v_j = (sum_j p_j v_j H) H, so it rotates the queries once (rotate()), attends over the
rows as load_rotated() gives them, and rotates the output back once per head (unrotate()), instead
of a 64x64 product for every cached row at every step. For the float formats and fp8 all three are
the identity. load() gives values in the model's basis, for code that reads rows directly (the
audit, tests).

NOTE: the scale lives in its row, as GGML's Q8_0 keeps a block's scale beside its codes, so the K
(or V) rows of one block of one layer with their scales are one contiguous byte range: the wire
codec gathers, checksums and writes a quantized block exactly as it does a float16 one, and a
block's scales can never arrive without it.

NOTE: the query's own row. An int8 query attends its own token's K and V as the model computed
them, in float32 (rotated), and every earlier token's as the pool stores them. It is what KIVI's
full-precision window of recent tokens is at its smallest, and the only width that needs no state:
a token's own K/V exist wherever its query does (a fresh prefill, a decode step, a recompute), and
every row in the pool stays pure int8, so capacity, the wire, the prefix cache and the tiers do
not change. It raises int8's greedy agreement with float32 (`python -m bench.kv_quant`;
docs/benchmarks.md, the int8 KV rows). A row's bytes then depend on
this rule too (the rows above layer 0 come from hidden states it computed), so it is part of
int8's row_format.

Exactness within a dtype: store() is a function of the float32 row alone (no state, no other
token), and every path reads rows back with load_rotated(). The model attends a fresh prefill over
load_rotated(store(k)) as well, and DecoderModel.reference_logits does the same, so a cached,
transferred or recomputed row is the row the no-cache reference attends over.

The pool's torch dtype names its format one to one (int8 -> "int8", float8_e4m3fn -> "fp8"), so
code that holds only the pool (the model, the wire codec, the audit) finds the format from it. A
format's row_format (pdserve/engine/config.py KVDtype) names the encoding of its rows in the engine
salt and the KV wire layout, so rows of int8's first encoding (symmetric, float32 scale, no
rotation) and of this one never mix.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

_SCALE_DTYPE = torch.float32
_AFFINE_DTYPE = torch.float16  # of an int8 row's scale and offset


class KVFormat:
    """What every format shares: a row's width, and the round trip every cache path attends over."""

    name: str
    storage_dtype: torch.dtype
    scale_elements: int  # elements of storage_dtype a row spends on its scale
    # True: a query attends its own token's K/V row as the model computed it (float32), and every
    # earlier token's as the pool stores it. See "the query's own row" in this module's docstring.
    own_row_in_float32: bool = False

    def store(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def load(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., head_dim] in the model's basis -> the basis rows are stored in (x itself here)."""
        return x

    def store_rotated(self, y: torch.Tensor) -> torch.Tensor:
        """store(x) given y = rotate(x), for a caller that holds y already (the same rows)."""
        return self.store(y)  # NOTE: rotate() is the identity here

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """y [..., head_dim] in the rows' basis -> the model's basis (y itself here)."""
        return y

    def load_rotated(self, rows: torch.Tensor) -> torch.Tensor:
        """rows -> float32 values in the rows' basis: what attention reads, with rotate()d queries."""
        return self.load(rows)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """The values a pool of this format gives back for x."""
        return self.load(self.store(x))

    def row_width(self, head_dim: int) -> int:
        """Elements of storage_dtype in one row."""
        return head_dim + self.scale_elements

    def head_dim(self, row_width: int) -> int:
        """The head_dim whose rows are row_width elements wide."""
        return row_width - self.scale_elements


@dataclass(frozen=True)
class CastFormat(KVFormat):
    """float32/float16/bfloat16: a row is head_dim values cast to the pool's dtype."""

    name: str
    storage_dtype: torch.dtype
    scale_elements: int = 0

    def store(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., head_dim] float32 -> rows in the pool's dtype (x itself for float32)."""
        return x.to(self.storage_dtype)

    def load(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., head_dim] -> float32 values (rows itself for float32)."""
        return rows.float()


@dataclass(frozen=True)
class ScaledFormat(KVFormat):
    """fp8: a row is head_dim codes and, after them, a float32 scale's bytes (scale_elements
    elements of the one-byte storage dtype)."""

    name: str
    storage_dtype: torch.dtype  # of the codes, one byte each
    code_max: float  # the largest code: 127 for int8, 448 (e4m3's largest finite value) for fp8
    scale_elements: int = _SCALE_DTYPE.itemsize

    def store(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., head_dim] float32 -> rows [..., head_dim + 4] of codes and scale."""
        scale = x.abs().amax(dim=-1, keepdim=True) / self.code_max
        scaled = (x / torch.where(scale > 0, scale, 1.0)).clamp(-self.code_max, self.code_max)
        if self.storage_dtype == torch.int8:
            codes = scaled.round().to(torch.int8)  # round half to even
        else:
            codes = scaled.to(self.storage_dtype)  # e4m3 rounds to nearest even itself
        # NOTE: the bytes are joined as uint8, never as e4m3 elements: a scale byte that reads as
        # an e4m3 NaN must go through unchanged.
        return torch.cat((codes.view(torch.uint8), scale.view(torch.uint8)), dim=-1).view(self.storage_dtype)

    def load(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., head_dim + 4] (any strides) -> float32 values [..., head_dim]."""
        raw = rows.view(torch.uint8)
        codes = raw[..., :-self.scale_elements].view(self.storage_dtype).float()
        # NOTE: contiguous() first: view(float32) needs 4-byte aligned scales, which a row has only
        # when head_dim is a multiple of 4.
        scale = raw[..., -self.scale_elements:].contiguous().view(_SCALE_DTYPE)
        return codes * scale


def hadamard(n: int, device: torch.device | None = None) -> torch.Tensor:
    """The orthonormal n x n rotation of a row: Sylvester Hadamard blocks of n's largest
    power-of-two divisor, divided by their root, on the diagonal. Symmetric, so its own inverse."""
    return _hadamard(n, torch.device("cpu") if device is None else device)


@cache
def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    block = n & -n
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)))
    return torch.block_diag(*[h / block ** 0.5] * (n // block)).to(device)


@dataclass(frozen=True)
class RotatedAffineFormat(KVFormat):
    """int8: a row is head_dim codes of the Hadamard-rotated row and, after them, a float16 scale
    and a float16 offset (2 x 2 bytes, so scale_elements = 4 one-byte elements)."""

    name: str
    storage_dtype: torch.dtype = torch.int8
    scale_elements: int = 2 * _AFFINE_DTYPE.itemsize
    own_row_in_float32: bool = True

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        return x @ hadamard(x.shape[-1], x.device)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        return y @ hadamard(y.shape[-1], y.device)  # NOTE: H is symmetric and orthogonal: H^-1 = H

    def store(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., head_dim] float32 -> rows [..., head_dim + 4] of codes, scale and offset."""
        return self.store_rotated(self.rotate(x))

    def store_rotated(self, y: torch.Tensor) -> torch.Tensor:
        """y = rotate(x) [..., head_dim] float32 -> the rows store(x) gives."""
        lo, hi = torch.aminmax(y, dim=-1, keepdim=True)
        exact = (hi - lo) / 255
        scale = exact.to(_AFFINE_DTYPE)
        # NOTE: rounded up, so that 255 steps still span the row and only the offset's rounding
        # can push a code past the int8 range (then clamped: a fraction of a step).
        scale = torch.where(scale.float() < exact, torch.nextafter(scale, torch.full_like(scale, torch.inf)),
                            scale)
        offset = (lo + 128 * scale.float()).to(_AFFINE_DTYPE)
        step = torch.where(scale > 0, scale.float(), 1.0)
        codes = ((y - offset.float()) / step).round().clamp(-128, 127).to(torch.int8)  # half to even
        affine = torch.cat((scale, offset), dim=-1).view(torch.uint8)
        return torch.cat((codes.view(torch.uint8), affine), dim=-1).view(torch.int8)

    def load_rotated(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., head_dim + 4] (any strides) -> float32 values [..., head_dim], still rotated."""
        raw = rows.view(torch.uint8)
        codes = raw[..., :-self.scale_elements].view(torch.int8).float()
        # NOTE: contiguous() first: view(float16) needs 2-byte aligned bytes, which a row has only
        # when head_dim is even.
        affine = raw[..., -self.scale_elements:].contiguous().view(_AFFINE_DTYPE).float()
        return codes.mul_(affine[..., :1]).add_(affine[..., 1:])  # NOTE: in place: codes is a fresh copy

    def load(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., head_dim + 4] -> float32 values [..., head_dim] in the model's basis."""
        return self.unrotate(self.load_rotated(rows))


KV_FORMATS: dict[str, KVFormat] = {
    "float32": CastFormat("float32", torch.float32),
    "float16": CastFormat("float16", torch.float16),
    "bfloat16": CastFormat("bfloat16", torch.bfloat16),
    "int8": RotatedAffineFormat("int8"),
    "fp8": ScaledFormat("fp8", torch.float8_e4m3fn, 448.0),
}

# The pool's torch dtype for each KV dtype name (pdserve/engine/config.py KV_DTYPES), one to one.
TORCH_DTYPES: dict[str, torch.dtype] = {name: f.storage_dtype for name, f in KV_FORMATS.items()}
_BY_TORCH_DTYPE = {f.storage_dtype: f for f in KV_FORMATS.values()}


def format_of(dtype: torch.dtype) -> KVFormat:
    """The format of a pool of this torch dtype."""
    if dtype not in _BY_TORCH_DTYPE:
        raise ValueError(f"a KV pool of {dtype} has no format; a pool is one of "
                         f"{', '.join(str(d) for d in _BY_TORCH_DTYPE)}")
    return _BY_TORCH_DTYPE[dtype]
