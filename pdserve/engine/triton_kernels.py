"""The Triton kernels of pdserve's paged attention (pdserve/engine/triton_attention.py launches them).

Imported only by triton_attention, and only once a call needs them: it imports triton at the top, and
triton is a dev dependency. Under TRITON_INTERPRET=1 (set before this module is first imported: the
decorator reads it) the same kernels run on the CPU, which is how the tests prove them.

    decode_kernel         grid (B, KVH, splits): one query per sequence; a program takes all query
                          heads of one KV head over one split's range of the block table, and writes
                          either the output (one split) or its (max, sum, partial output)
    decode_reduce_kernel  grid (B * H): merges the splits' partials by their softmax sums
    prefill_kernel        grid (query tiles, KVH): a chunk's queries over its sequence's rows, causal,
                          the cached prefix and the chunk's own rows alike through the block table

Row formats (kv_format.py), by the FORMAT constexpr: CAST (float32/float16/bfloat16 values), AFFINE
(int8: code * scale + offset, float16 scale and offset after the codes) and SCALED (fp8: e4m3 code *
float32 scale after the codes). Values come out as load_rotated() gives them, in the rows' basis: the
model rotates the queries and the output, never a row here.

NOTE: every tile is upcast to float32 before tl.dot, and every tl.dot asks for input_precision="ieee":
the interpreter multiplies a bfloat16 tile's raw bit patterns, and a GPU's float32 dot defaults to
TF32, either of which would break the exactness against attention_reference.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

CAST = tl.constexpr(0)
AFFINE = tl.constexpr(1)
SCALED = tl.constexpr(2)


@triton.jit
def _tail_byte(row_ptr, i, row_mask, stride_e, HEAD_DIM: tl.constexpr):
    """Byte i after a row's codes, as uint32 (0 where the row is masked)."""
    return tl.load(row_ptr + (HEAD_DIM + i) * stride_e, mask=row_mask, other=0).to(tl.uint32)


@triton.jit
def _load_rows(base_ptr, row_offsets, row_mask, d, d_mask, stride_e, lut_ptr,
               HEAD_DIM: tl.constexpr, FORMAT: tl.constexpr):
    """[N, BLOCK_D] float32 values of the rows at base_ptr + row_offsets (0 where masked).

    NOTE: a scale is rebuilt from its bytes, never loaded as a float: a row of head_dim % 4 != 0 has
    its scale unaligned."""
    mask = row_mask[:, None] & d_mask[None, :]
    ptrs = base_ptr + row_offsets[:, None] + (d * stride_e)[None, :]
    if FORMAT == CAST:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    codes = tl.load(ptrs, mask=mask, other=0)  # uint8
    row_ptr = base_ptr + row_offsets
    b0 = _tail_byte(row_ptr, 0, row_mask, stride_e, HEAD_DIM)
    b1 = _tail_byte(row_ptr, 1, row_mask, stride_e, HEAD_DIM)
    b2 = _tail_byte(row_ptr, 2, row_mask, stride_e, HEAD_DIM)
    b3 = _tail_byte(row_ptr, 3, row_mask, stride_e, HEAD_DIM)
    if FORMAT == AFFINE:
        row_scale = (b0 | (b1 << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        offset = (b2 | (b3 << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        return codes.to(tl.int8, bitcast=True).to(tl.float32) * row_scale[:, None] + offset[:, None]
    row_scale = (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)
    # NOTE: e4m3 codes decoded by a 256-entry table: exact, and the same on the interpreter and a GPU.
    return tl.load(lut_ptr + codes.to(tl.int32)) * row_scale[:, None]


@triton.jit
def _attend_tile(q, k, v, allowed, m_i, l_i, acc, scale):
    """One online-softmax step over a key tile; allowed [M, N] masks the scores. A row with no allowed
    key so far keeps max -inf, sum 0 and output 0 (never NaN)."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m_new, l_i, acc


# NOTE: the scalars that change from call to call are not specialized (Triton compiles a variant for
# a value of 1 or a multiple of 16), so a step never meets a fresh compile, inside a graph capture or not.
@triton.jit(do_not_specialize=["scale", "window"])
def decode_kernel(q_ptr, cache_ptr, table_ptr, lens_ptr, own_k_ptr, own_v_ptr, lut_ptr,
                  out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                  scale, window, blocks_per_split, num_heads, num_splits,
                  stride_qb, stride_qh, stride_qd,
                  stride_kv, stride_blk, stride_slot, stride_head, stride_e,
                  stride_tb, stride_tw,
                  stride_okb, stride_okh, stride_okd, stride_ovb, stride_ovh, stride_ovd,
                  BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  FORMAT: tl.constexpr, HAS_OWN: tl.constexpr, SPLIT: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    g = tl.arange(0, GROUP_PAD)
    g_mask = g < GROUP
    head = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    if HAS_OWN:
        own_k = tl.load(own_k_ptr + b * stride_okb + kvh * stride_okh + d * stride_okd,
                        mask=d_mask, other=0.0)
        own_v = tl.load(own_v_ptr + b * stride_ovb + kvh * stride_ovh + d * stride_ovd,
                        mask=d_mask, other=0.0)
    # NOTE: a split's range is fixed by the table's width, never by the lengths, so the grid and the
    # scratch follow from shapes alone; a split past a row's context runs no tile.
    lo = split * blocks_per_split * BLOCK_SIZE
    hi = tl.minimum(lo + blocks_per_split * BLOCK_SIZE, ctx)
    lo = tl.maximum(lo, tl.where(window > 0, ctx - window, 0))
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    table_row = table_ptr + b * stride_tb
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        block = tl.load(table_row + (n // BLOCK_SIZE) * stride_tw, mask=n_mask, other=0).to(tl.int64)
        rows = block * stride_blk + (n % BLOCK_SIZE) * stride_slot + kvh * stride_head
        k = _load_rows(cache_ptr, rows, n_mask, d, d_mask, stride_e, lut_ptr, HEAD_DIM, FORMAT)
        v = _load_rows(cache_ptr + stride_kv, rows, n_mask, d, d_mask, stride_e, lut_ptr, HEAD_DIM, FORMAT)
        if HAS_OWN:
            own = (n == ctx - 1)[:, None]
            k = tl.where(own, own_k[None, :], k)
            v = tl.where(own, own_v[None, :], v)
        m_i, l_i, acc = _attend_tile(q, k, v, n_mask[None, :], m_i, l_i, acc, scale)
    bh = b * num_heads + head
    if SPLIT:
        part = bh * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])
    else:
        out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
        tl.store(out_ptr + bh[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def decode_reduce_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, num_splits,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr):
    bh = tl.program_id(0)
    s = tl.arange(0, SPLITS_PAD)
    s_mask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    part = bh * num_splits + s
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # an empty split weighs 0
    total = tl.sum(l_s * weight, 0)
    out = tl.sum(acc * weight[:, None], 0)
    out = tl.where(total > 0, out / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(out_ptr + bh * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit(do_not_specialize=["scale", "window", "start", "num_tokens"])
def prefill_kernel(q_ptr, cache_ptr, table_ptr, own_k_ptr, own_v_ptr, lut_ptr, out_ptr,
                   scale, window, start, num_tokens, num_heads,
                   stride_qt, stride_qh, stride_qd,
                   stride_kv, stride_blk, stride_slot, stride_head, stride_e, stride_tw,
                   stride_okt, stride_okh, stride_okd, stride_ovt, stride_ovh, stride_ovd,
                   BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, FORMAT: tl.constexpr, HAS_OWN: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    # NOTE: a program's rows are BLOCK_M tokens x the KV head's GROUP_PAD query heads, so each key
    # tile is loaded once for all of them.
    r = tl.arange(0, BLOCK_M * GROUP_PAD)
    t = tile * BLOCK_M + r // GROUP_PAD
    g = r % GROUP_PAD
    row_valid = (t < num_tokens) & (g < GROUP)
    head = kvh * GROUP + g
    pos = start + t
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    io_mask = row_valid[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=io_mask, other=0.0).to(tl.float32)
    first_pos = start + tile * BLOCK_M
    hi = start + tl.minimum(tile * BLOCK_M + BLOCK_M, num_tokens)  # past the tile's last query
    lo = tl.where(window > 0, tl.maximum(first_pos - window + 1, 0), 0)
    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], tl.float32)
    for key_start in range(lo, hi, BLOCK_N):
        n = key_start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        block = tl.load(table_ptr + (n // BLOCK_SIZE) * stride_tw, mask=n_mask, other=0).to(tl.int64)
        rows = block * stride_blk + (n % BLOCK_SIZE) * stride_slot + kvh * stride_head
        k = _load_rows(cache_ptr, rows, n_mask, d, d_mask, stride_e, lut_ptr, HEAD_DIM, FORMAT)
        v = _load_rows(cache_ptr + stride_kv, rows, n_mask, d, d_mask, stride_e, lut_ptr, HEAD_DIM, FORMAT)
        if HAS_OWN:  # the query's own position comes from its own row, after the loop
            allowed = n[None, :] < pos[:, None]
        else:
            allowed = n[None, :] <= pos[:, None]
        allowed = allowed & n_mask[None, :] & ((window == 0) | (n[None, :] > pos[:, None] - window))
        m_i, l_i, acc = _attend_tile(q, k, v, allowed, m_i, l_i, acc, scale)
    if HAS_OWN:
        own_k = tl.load(own_k_ptr + t[:, None] * stride_okt + kvh * stride_okh + d[None, :] * stride_okd,
                        mask=io_mask, other=0.0)
        own_v = tl.load(own_v_ptr + t[:, None] * stride_ovt + kvh * stride_ovh + d[None, :] * stride_ovd,
                        mask=io_mask, other=0.0)
        own_score = tl.sum(q * own_k, 1) * scale
        m_new = tl.maximum(m_i, own_score)
        alpha = tl.exp(m_i - m_new)
        own_weight = tl.exp(own_score - m_new)
        l_i = l_i * alpha + own_weight
        acc = acc * alpha[:, None] + own_weight[:, None] * own_v
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(out_ptr + (t[:, None] * num_heads + head[:, None]) * HEAD_DIM + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)
