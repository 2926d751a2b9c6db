"""pdserve's paged attention in Triton: decode rows and prefill chunks over the paged pool, read where
the rows lie through the block tables, in any row format of kv_format.py (the GPU's counterpart of
cpu_kernels' paged attention, and drop-ins for model.PagedAttention's decode and prefill).

    paged_decode_attention(q, cache, block_tables, context_lens, scale, window=0, *, own_k, own_v,
                           kv_splits)       one query per sequence, split-KV, no host sync
    paged_prefill_attention(q, cache, block_table, start, scale, window=0, *, own_k, own_v)
                                            one chunk of one sequence, causal
    unavailable()                           why the kernels cannot run here, in words (None when they can)

cache is one layer of the pool, [2, blocks, block_size, KVH, row] (K at [0], V at [1]), read through
its strides. window 0: every key; else the query at position p sees keys p - window < j <= p. own_k /
own_v (int8's own_row_in_float32, [B or T, KVH, D] float32, rows' basis): a query's own position takes
them instead of its pool row. The output has q's dtype; everything in between is float32.
attention_reference.py is the same computation in plain torch.

Lifecycle: this module imports without triton (a dev dependency); the kernels (triton_kernels.py) are
imported on the first call, so TRITON_INTERPRET=1 must be set before it to run them on the CPU.

NOTE: why split-KV in decode. A decode step has one query row per sequence, so a grid of (B, KVH)
programs leaves most of a GPU idle at small batches over long contexts; splitting each table into
ranges gives more programs, merged by a small second kernel by their softmax sums. The split count
comes from shapes only (the table's width, the batch) so the decode wrapper never reads a tensor's
value on the host: a step is captured into a CUDA graph and replayed for any lengths.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from types import ModuleType

import torch

from pdserve.engine.kv_format import RotatedAffineFormat, ScaledFormat, format_of

# Programs a decode launch aims for before it splits the keys further (about two per SM of a large GPU).
TARGET_DECODE_PROGRAMS = 256
MIN_BLOCKS_PER_SPLIT = 4  # a split shorter than this costs more in merging than it saves
MAX_SPLITS = 32


def unavailable() -> str | None:
    """Why the Triton kernels cannot run here, or None when they can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (it is a dev dependency: pip install triton)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if not torch.cuda.is_available():
        return "no CUDA device, and TRITON_INTERPRET is not 1 (the interpreter runs the kernels on the CPU)"
    return None


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (on the CPU, for tests) rather than on a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@cache
def _kernels() -> ModuleType:
    from pdserve.engine import triton_kernels

    return triton_kernels


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def default_kv_splits(batch: int, kv_heads: int, width: int) -> int:
    """Splits of a decode launch from its shapes alone: enough programs to fill the GPU, no split
    shorter than MIN_BLOCKS_PER_SPLIT blocks of the table."""
    wanted = -(-TARGET_DECODE_PROGRAMS // max(batch * kv_heads, 1))
    return max(1, min(wanted, width // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS))


def _format_code(dtype: torch.dtype) -> int:
    fmt = format_of(dtype)
    if isinstance(fmt, RotatedAffineFormat):
        return 1  # triton_kernels.AFFINE
    if isinstance(fmt, ScaledFormat):
        return 2  # triton_kernels.SCALED
    return 0  # triton_kernels.CAST


@cache
def _e4m3_table(device: torch.device) -> torch.Tensor:
    """The float32 value of each e4m3fn byte, once per device. NOTE: built on the device (no host copy),
    so even a first call inside a CUDA graph capture is legal."""
    codes = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    return codes.view(torch.float8_e4m3fn).float()


def _pool_and_table(cache: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The format's code, the pool as the kernels address it (bytes for the quantized formats: a
    view, never a copy) and the e4m3 table (a stand-in where unused)."""
    code = _format_code(cache.dtype)
    pool = cache.view(torch.uint8) if code else cache
    return code, pool, _e4m3_table(cache.device)


def _head_dims(q: torch.Tensor, cache: torch.Tensor) -> tuple[int, int, int]:
    """head_dim, the pool's KV heads and the query heads per KV head, checked against each other."""
    heads, head_dim = q.shape[-2], q.shape[-1]
    kv_heads = cache.shape[3]
    if format_of(cache.dtype).head_dim(cache.shape[-1]) != head_dim:
        raise ValueError(f"q's head_dim {head_dim} does not match the pool's rows of {cache.shape[-1]}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    return head_dim, kv_heads, heads // kv_heads


def _key_tile(head_dim: int) -> int:
    return 32 if head_dim > 64 else 64


def _own_strides(own: torch.Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if own is None else own.stride()


def _has_own_rows(own_k: torch.Tensor | None, own_v: torch.Tensor | None, shape: tuple[int, ...]) -> bool:
    """Whether own rows were given, both of the queries' shape [rows, KVH, D]."""
    if own_k is None and own_v is None:
        return False
    if own_k is None or own_v is None or own_k.shape != shape or own_v.shape != shape:
        raise ValueError(f"own_k and own_v must both be {shape}")
    return True


def paged_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, window: int = 0, *,
                           own_k: torch.Tensor | None = None, own_v: torch.Tensor | None = None,
                           kv_splits: int | None = None) -> torch.Tensor:
    """q [B, H, D] over each row's context_lens[b] keys through block_tables [B, width] -> [B, H, D] in
    q's dtype; a row of context 0 gives 0. kv_splits: ranges of the table attended apart and merged
    (1: off; None: default_kv_splits). Reads no tensor value on the host (CUDA graph safe)."""
    batch, heads, _ = q.shape
    head_dim, kv_heads, group = _head_dims(q, cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    width = block_tables.shape[1]
    splits = kv_splits or default_kv_splits(batch, kv_heads, width)
    blocks_per_split = -(-width // splits)
    fmt_code, pool, table = _pool_and_table(cache)
    has_own = _has_own_rows(own_k, own_v, (batch, kv_heads, head_dim))
    if splits > 1:
        part_m = torch.empty(batch * heads * splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(batch * heads * splits * head_dim, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # NOTE: unused when there is one split
    block_d = _next_pow2(head_dim)
    kernels = _kernels()
    kernels.decode_kernel[(batch, kv_heads, splits)](
        q, pool, block_tables, context_lens, own_k if has_own else q, own_v if has_own else q, table,
        out, part_m, part_l, part_acc,
        scale, window, blocks_per_split, heads, splits,
        *q.stride(), pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3), pool.stride(4),
        *block_tables.stride(), *_own_strides(own_k), *_own_strides(own_v),
        BLOCK_SIZE=cache.shape[2], GROUP=group, GROUP_PAD=max(16, _next_pow2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=_key_tile(head_dim),
        FORMAT=fmt_code, HAS_OWN=has_own, SPLIT=splits > 1)
    if splits > 1:
        kernels.decode_reduce_kernel[(batch * heads,)](
            part_m, part_l, part_acc, out, splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS_PAD=_next_pow2(splits))
    return out


def paged_prefill_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, start: int,
                            scale: float, window: int = 0, *, own_k: torch.Tensor | None = None,
                            own_v: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] at positions start..start+T-1 over the sequence's rows through block_table [width]
    (the chunk's own rows already written), causal -> [T, H, D] in q's dtype."""
    tokens, heads, _ = q.shape
    head_dim, kv_heads, group = _head_dims(q, cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    fmt_code, pool, table = _pool_and_table(cache)
    has_own = _has_own_rows(own_k, own_v, (tokens, kv_heads, head_dim))
    group_pad = _next_pow2(group)
    block_m = max(16, 64 // group_pad)  # query tokens a program: 64 rows up to 4 heads a KV head
    _kernels().prefill_kernel[(-(-tokens // block_m), kv_heads)](
        q, pool, block_table, own_k if has_own else q, own_v if has_own else q, table, out,
        scale, window, start, tokens, heads,
        *q.stride(), pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3), pool.stride(4),
        block_table.stride(0), *_own_strides(own_k), *_own_strides(own_v),
        BLOCK_SIZE=cache.shape[2], GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        BLOCK_D=_next_pow2(head_dim), BLOCK_M=block_m, BLOCK_N=_key_tile(head_dim),
        FORMAT=fmt_code, HAS_OWN=has_own)
    return out
