"""How K/V rows are stored in the paged pool: cast to a float type, or quantized with a scale.

A pool is kv[layer, K|V, block, offset, kv_head, row]: one row is one token's K (or V) for one KV
head. A float32/float16/bfloat16 row is the head_dim values, cast. An int8 or fp8 row is a
symmetric per-token, per-KV-head quantization, its float32 scale stored at the end of the row:

    int8 row, head_dim 64:   | c0 c1 ... c63 | s0 s1 s2 s3 |   68 bytes (float32: 256, float16: 128)
                               codes            the scale's 4 bytes
    scale = max_i |x_i| / 127 (fp8: / 448)    code_i = x_i / scale, rounded to int8 (fp8: to e4m3)
    value_i = code_i x scale, in float32

NOTE: the scale lives in its row, as GGML's Q8_0 keeps a block's scale beside its codes, so the K
(or V) rows of one block of one layer with their scales are one contiguous byte range: the wire
codec gathers, checksums and writes a quantized block exactly as it does a float16 one, and a
block's scales can never arrive without it.

Exactness within a dtype: store() is a function of the float32 rows alone (no state, no other
token), and every path reads rows back with load(). The model attends a fresh prefill over
load(store(k)) as well, and LlamaModel.reference_logits applies the same round trip, so a cached,
transferred or recomputed row is the row the no-cache reference attends over.

The pool's torch dtype names its format one to one (int8 -> "int8", float8_e4m3fn -> "fp8"), so
code that holds only the pool (the model, the wire codec, the audit) finds the format from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SCALE_DTYPE = torch.float32


class KVFormat:
    """What both formats share: a row's width, and the round trip every cache path attends over."""

    name: str
    storage_dtype: torch.dtype
    scale_elements: int  # elements of storage_dtype a row spends on its scale

    def store(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def load(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

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
    """int8/fp8: a row is head_dim codes and, after them, a float32 scale's bytes (scale_elements
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


KV_FORMATS: dict[str, KVFormat] = {
    "float32": CastFormat("float32", torch.float32),
    "float16": CastFormat("float16", torch.float16),
    "bfloat16": CastFormat("bfloat16", torch.bfloat16),
    "int8": ScaledFormat("int8", torch.int8, 127.0),
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
