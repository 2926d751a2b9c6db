"""The native paged attention kernels (EngineConfig.attention_kernel "native": decode rows and prefill
chunks) under the exactness suite.

Each kernel against float64 attention over the same rows, for shapes that leave every tail; then the
engine on them against the no-cache reference (tests/engine/test_exactness.py's assertions and 1e-4),
every cache path, with torch's matmul and with the native linear kernel; then against transformers on
greedy tokens. The reference attends with SDPA, so every step compares the two attentions.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers.masking_utils import sliding_window_causal_mask_function

from pdserve.engine import cpu_kernels
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.model import select_attention
from pdserve.engine.sequence import SamplingParams
from pdserve.field_error import FieldError
from tests.conftest import make_engine
from tests.engine.kernel_checks import (
    check_cache_paths,
    check_decode_filled_blocks_audit_clean,
    check_greedy_matches_transformers,
    needs_kernel,
    run_capped_to_avx2,
)
from tests.engine.test_exactness import check_against_reference, varied_prompts
from tests.engine.test_linear_kernels import ONEDNN_VS_TRANSFORMERS, needs_native
from tests.engine.test_oracle import hf_greedy, hf_logits

CPU = torch.device("cpu")


def paged_case(seed: int, lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int):
    """A pool layer of random rows and, per sequence, a table of shuffled blocks padded with block 0."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    blocks = len(lens) * width + 3
    cache = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=g)
    order = torch.randperm(blocks, generator=g)
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    for b, n in enumerate(lens):
        used = -(-n // block_size)
        tables[b, :used] = order[b * width:b * width + used]
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    return q, cache, tables, torch.tensor(lens)


def float64_attention(q, cache, tables, lens, scale):
    """Each sequence's rows read in order through its table; softmax(q k / sqrt d) v in float64."""
    heads, kv_heads, block_size = q.shape[1], cache.shape[3], cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        slots = [(int(tables[b, t // block_size]), t % block_size) for t in range(n)]
        k = torch.stack([cache[0, blk, off] for blk, off in slots]).double()  # [n, kvh, d]
        v = torch.stack([cache[1, blk, off] for blk, off in slots]).double()
        for h in range(heads):
            g = h // (heads // kv_heads)
            p = torch.softmax(k[:, g] @ q[b, h].double() * scale, dim=0)
            out[b, h] = p @ v[:, g]
    return out


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 2, 16), (3, 3, 12), (2, 1, 5)],
                         ids=["smollm2", "tiny", "no-gqa-tail", "under-one-vector"])
def test_paged_attention_matches_float64_over_the_same_rows(heads, kv_heads, head_dim):
    """Lengths of one token, a whole block, a block and one, and several blocks; head_dims that
    leave tails of the 8-lane vectors."""
    lens = [1, 16, 17, 5, 70, 33]
    q, cache, tables, ctx = paged_case(heads * head_dim, lens, heads, kv_heads, head_dim, block_size=16)
    scale = head_dim ** -0.5
    ours = cpu_kernels.paged_decode_attention()(q, cache, tables, ctx, scale)
    assert ours.shape == q.shape
    expected = float64_attention(q, cache, tables, ctx, scale)
    assert torch.allclose(ours.double(), expected, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_a_sequence_attends_alike_alone_and_in_a_batch():
    """Bit for bit: a row's result depends on its own rows only, not on its neighbours' lengths."""
    q, cache, tables, lens = paged_case(7, [3, 90, 41, 16, 1], 9, 3, 64, block_size=16)
    attend = cpu_kernels.paged_decode_attention()
    together = attend(q, cache, tables, lens, 0.125)
    for b in range(len(lens)):
        n_blocks = -(-int(lens[b]) // 16)
        table = tables[b:b + 1, :n_blocks].contiguous()
        alone = attend(q[b:b + 1].contiguous(), cache, table, lens[b:b + 1], 0.125)
        assert torch.equal(alone[0], together[b])


@needs_kernel
def test_a_padded_row_of_context_zero_gives_zeros_and_leaves_the_others_alone():
    """A static decode step's padding (pdserve/engine/static_decode.py): context 0 reads nothing."""
    q, cache, tables, lens = paged_case(5, [20, 8, 33], 4, 2, 16, block_size=16)
    attend = cpu_kernels.paged_decode_attention()
    padded = torch.tensor([20, 0, 33])
    out, plain = attend(q, cache, tables, padded, 0.25), attend(q, cache, tables, lens, 0.25)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0], plain[0]) and torch.equal(out[2], plain[2])


@needs_kernel
def test_paged_attention_refuses_a_length_past_its_table_or_a_block_past_the_pool():
    q, cache, tables, lens = paged_case(3, [20, 8], 4, 2, 16, block_size=16)
    attend = cpu_kernels.paged_decode_attention()
    with pytest.raises(RuntimeError, match="context length 33 of row 0 is outside 0..32"):
        attend(q, cache, tables, torch.tensor([33, 8]), 0.25)
    with pytest.raises(RuntimeError, match="context length -1 of row 1 is outside 0..32"):
        attend(q, cache, tables, torch.tensor([20, -1]), 0.25)
    bad = tables.clone()
    bad[1, 0] = cache.shape[1]
    with pytest.raises(RuntimeError, match=f"block {cache.shape[1]} of row 1 is outside"):
        attend(q, cache, bad, lens, 0.25)


def prefill_case(seed: int, start: int, tokens: int, heads: int, kv_heads: int, head_dim: int,
                 block_size: int):
    """A pool layer of random rows, a chunk's queries from position start, and the sequence's table of
    shuffled blocks covering start + tokens rows."""
    g = torch.Generator().manual_seed(seed)
    used = -(-(start + tokens) // block_size)
    cache = torch.randn(2, used + 3, block_size, kv_heads, head_dim, generator=g)
    table = torch.randperm(used + 3, generator=g)[:used].contiguous()
    return torch.randn(tokens, heads, head_dim, generator=g), cache, table


def float64_chunk_attention(q, cache, table, start: int, scale: float) -> torch.Tensor:
    """Query i (position start + i) over the sequence's rows 0..start+i read in order, in float64."""
    tokens, heads = q.shape[:2]
    kv_heads, block_size = cache.shape[3], cache.shape[2]
    slots = [(int(table[t // block_size]), t % block_size) for t in range(start + tokens)]
    k = torch.stack([cache[0, blk, off] for blk, off in slots]).double()  # [ctx, kvh, d]
    v = torch.stack([cache[1, blk, off] for blk, off in slots]).double()
    future = torch.arange(start + tokens)[None, :] > torch.arange(start, start + tokens)[:, None]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(heads):
        g = h // (heads // kv_heads)
        scores = (q[:, h].double() @ k[:, g].T * scale).masked_fill(future, -torch.inf)
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, g]
    return out


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 2, 16), (3, 3, 12), (2, 1, 5)],
                         ids=["smollm2", "tiny", "no-gqa-tail", "under-one-vector"])
@pytest.mark.parametrize("start, tokens", [(0, 1), (0, 13), (0, 70), (5, 1), (16, 16), (17, 30), (90, 7)])
def test_paged_prefill_attention_matches_float64_over_the_same_rows(heads, kv_heads, head_dim, start, tokens):
    """Fresh chunks and chunks after cached rows; query rows that fill, or leave a tail of, the kernel's
    12-row items; key tiles that end mid-block; head_dims that leave tails of the 8 and 16 lanes."""
    q, cache, table = prefill_case(start * 100 + tokens, start, tokens, heads, kv_heads, head_dim, 16)
    scale = head_dim ** -0.5
    ours = cpu_kernels.paged_prefill_attention()(q, cache, table, start, scale)
    assert ours.shape == q.shape
    assert torch.allclose(ours.double(), float64_chunk_attention(q, cache, table, start, scale),
                          atol=1e-5, rtol=1e-5)


PATH_SHAPES = [(9, 3, 64), (4, 2, 16), (3, 3, 12), (2, 1, 5), (8, 1, 128)]
PATH_CHUNKS = [(0, 1), (0, 13), (5, 1), (17, 30), (90, 7), (33, 3), (300, 14), (40, 70)]


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, head_dim", PATH_SHAPES,
                         ids=["smollm2", "tiny", "no-gqa-tail", "under-one-vector", "one-kv-head-128"])
def test_the_lanes_and_tiled_paths_give_the_same_bits(heads, kv_heads, head_dim):
    """A chunk of few rows a KV head takes the lanes path, a longer one the tiled path: on any chunk
    the two give the same bits (and match float64), so which one a chunk took never shows. At 1 to 4
    threads, since the lanes path splits its items to the thread count (14 queries of SmolLM2: one
    item of 3 vectors a KV head on 1 or 3 threads, one head's split in 1 + 2 on 2 or 4)."""
    lanes = cpu_kernels.paged_prefill_attention_on("lanes")
    tiled = cpu_kernels.paged_prefill_attention_on("tiled")
    scale = head_dim ** -0.5
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3, 4):
            torch.set_num_threads(count)
            for start, tokens in PATH_CHUNKS:
                q, cache, table = prefill_case(start * 100 + tokens, start, tokens, heads, kv_heads,
                                               head_dim, 16)
                ours = lanes(q, cache, table, start, scale)
                assert torch.equal(ours, tiled(q, cache, table, start, scale)), (count, start, tokens)
                assert torch.allclose(ours.double(), float64_chunk_attention(q, cache, table, start, scale),
                                      atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_a_prefill_row_attends_alike_in_any_chunk_and_at_any_thread_count():
    """Bit for bit: a row's sums run over key tiles fixed from key 0, so chunking a prompt (chunked
    prefill, a prefix hit, the audit's recompute) or the thread count never changes its bits. The
    whole prompt has more rows a KV head than the lanes path takes and the short chunks fewer, so the
    chunkings cross the two paths."""
    tokens = cpu_kernels.prefill_attention_lane_rows() // 3 + 10  # 3 rows a query: 9 heads, 3 KV heads
    q, cache, table = prefill_case(3, 0, tokens, 9, 3, 64, 16)
    attend = cpu_kernels.paged_prefill_attention()
    whole = attend(q, cache, table, 0, 0.125)
    for cuts in ([0, 13, 40, tokens], [0, 1, 2, tokens - 1, tokens], [0, tokens // 2, tokens]):
        chunks = [attend(q[a:b].contiguous(), cache, table, a, 0.125) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(chunks), whole)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(attend(q, cache, table, 0, 0.125), whole)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_an_unknown_prefill_attention_path_is_refused_by_name():
    q, cache, table = prefill_case(4, 0, 3, 4, 2, 16, 16)
    with pytest.raises(RuntimeError, match="path must be auto, lanes or tiled, not rows"):
        torch.ops.pdserve.paged_prefill_attention_on(q, cache, table, 0, 0.25, "rows")


CAPPED_PATHS = """
from pdserve.engine import cpu_kernels
from tests.engine.test_attention_kernels import PATH_SHAPES, test_the_lanes_and_tiled_paths_give_the_same_bits
assert cpu_kernels.gemv_isa() == "avx2", cpu_kernels.gemv_isa()
for shape in PATH_SHAPES:
    test_the_lanes_and_tiled_paths_give_the_same_bits(*shape)
print("checked")
"""


@needs_kernel
def test_the_two_paths_give_the_same_bits_in_8_lanes_too():
    """PDSERVE_CPU_ISA=avx2 runs the 8-lane build on an AVX-512 CPU too: its probability sums fold in
    another order, which the lanes path follows."""
    run_capped_to_avx2(CAPPED_PATHS)


@needs_kernel
def test_paged_prefill_attention_refuses_a_table_too_short_or_a_block_past_the_pool():
    q, cache, table = prefill_case(5, 20, 12, 4, 2, 16, 16)
    attend = cpu_kernels.paged_prefill_attention()
    too_short = "12 queries from position 21 need 33 rows; the block table holds 32"
    with pytest.raises(RuntimeError, match=too_short):
        attend(q, cache, table, 21, 0.25)
    bad = table.clone()
    bad[1] = cache.shape[1]
    pool = cache.shape[1]
    with pytest.raises(RuntimeError, match=f"block {pool} is outside the pool's {pool} blocks"):
        attend(q, cache, bad, 20, 0.25)


# ---- Sliding windows: Gemma 3's local layers, Mistral's windowed ones ----

# Gemma 3 270M's attention (4 query heads on 1 KV head of 256), then head_dims 256, 128 and 32 at
# groups of 1, 2 and 4 query heads a KV head.
WINDOW_SHAPES = [(4, 1, 256)] + [(2 * group, 2, d) for d in (256, 128, 32) for group in (1, 2, 4)]
WINDOW_SHAPE_IDS = ["gemma3-270m"] + [f"d{d}-group{group}" for d in (256, 128, 32) for group in (1, 2, 4)]
# blocks of 16: a window of the query's own key, under a block, of one, over one, past every context
WINDOWS = [1, 3, 16, 20, 500]
WINDOW_IDS = ["own-key", "under-a-block", "a-block", "over-a-block", "past-the-context"]
# decode lengths around and across the windows and the blocks
DECODE_LENS = [1, 2, 3, 4, 15, 16, 17, 19, 20, 21, 23, 31, 32, 33, 36, 37, 48, 70]
# prefill chunks from 0 and after cached rows; the last three longer than the lanes path takes at
# some shapes, so both paths run on their own as well as when named
WINDOW_CHUNKS = [(0, 1), (0, 13), (5, 1), (16, 16), (17, 30), (90, 7), (300, 14), (0, 70), (40, 100)]


def context_rows(cache: torch.Tensor, table: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's rows 0..n-1 read in order through its block table: K and V, [n, KVH, D] each."""
    block_size = cache.shape[2]
    blocks, offsets = table[torch.arange(n) // block_size], torch.arange(n) % block_size
    return cache[0, blocks, offsets], cache[1, blocks, offsets]


def masked_sdpa(q, k, v, positions: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """q [T, H, D] at positions over k, v [n, KVH, D]: torch's SDPA in float32 under transformers' own
    mask function (sliding_window_causal_mask_function: p - window < j <= p)."""
    keys = torch.arange(k.shape[0])
    mask = sliding_window_causal_mask_function(window)(0, 0, positions[:, None], keys[None, :])
    group = q.shape[1] // k.shape[1]
    k, v = (rows.repeat_interleave(group, dim=1).transpose(0, 1) for rows in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def poison_before(cache: torch.Tensor, table: torch.Tensor, first: int) -> None:
    """NaN in the K and V rows of positions 0..first-1: a kernel that reads one (or weighs its value by
    a zero) returns NaN."""
    block_size = cache.shape[2]
    for t in range(max(first, 0)):
        cache[:, table[t // block_size], t % block_size] = torch.nan


@needs_kernel
@pytest.mark.parametrize("window", WINDOWS, ids=WINDOW_IDS)
@pytest.mark.parametrize("heads, kv_heads, head_dim", WINDOW_SHAPES, ids=WINDOW_SHAPE_IDS)
def test_windowed_decode_matches_masked_sdpa_reading_no_row_before_its_window(heads, kv_heads, head_dim,
                                                                              window):
    """One call for rows of mixed lengths, each its query at position len - 1 over its last `window`
    rows; every row before a window is NaN in the pool, so a kernel that read it would show."""
    q, cache, tables, lens = paged_case(window * 1000 + head_dim + heads, DECODE_LENS, heads, kv_heads,
                                        head_dim, block_size=16)
    scale = head_dim ** -0.5
    expected = torch.cat([masked_sdpa(q[b:b + 1], *context_rows(cache, tables[b], n), torch.tensor([n - 1]),
                                      window, scale) for b, n in enumerate(DECODE_LENS)])
    for b, n in enumerate(DECODE_LENS):
        poison_before(cache, tables[b], n - window)
    ours = cpu_kernels.paged_decode_attention()(q, cache, tables, lens, scale, window)
    assert torch.allclose(ours, expected, atol=1e-5, rtol=1e-5), (ours - expected).abs().max()


@needs_kernel
@pytest.mark.parametrize("window", WINDOWS, ids=WINDOW_IDS)
@pytest.mark.parametrize("heads, kv_heads, head_dim", WINDOW_SHAPES, ids=WINDOW_SHAPE_IDS)
def test_windowed_prefill_matches_masked_sdpa_on_both_paths(heads, kv_heads, head_dim, window):
    """Chunks from position 0 and after cached rows, on the lanes and the tiled path: the same bits,
    SDPA's result under the window's mask, and no read of a row before the chunk's first window (NaN
    in the pool there)."""
    paths = {path: cpu_kernels.paged_prefill_attention_on(path) for path in ("lanes", "tiled")}
    auto = cpu_kernels.paged_prefill_attention()
    scale = head_dim ** -0.5
    for start, tokens in WINDOW_CHUNKS:
        q, cache, table = prefill_case(start * 100 + tokens + window, start, tokens, heads, kv_heads,
                                       head_dim, 16)
        positions = torch.arange(start, start + tokens)
        expected = masked_sdpa(q, *context_rows(cache, table, start + tokens), positions, window, scale)
        poison_before(cache, table, start + 1 - window)
        lanes = paths["lanes"](q, cache, table, start, scale, window)
        assert torch.equal(lanes, paths["tiled"](q, cache, table, start, scale, window)), (start, tokens)
        assert torch.equal(lanes, auto(q, cache, table, start, scale, window)), (start, tokens)
        assert torch.allclose(lanes, expected, atol=1e-5, rtol=1e-5), (start, tokens,
                                                                        (lanes - expected).abs().max())


@needs_kernel
def test_window_zero_or_past_the_context_is_no_limit_bit_for_bit():
    """The default, window 0, and a window longer than every context give the unwindowed bits."""
    q, cache, tables, lens = paged_case(8, DECODE_LENS, 4, 1, 256, block_size=16)
    decode = cpu_kernels.paged_decode_attention()
    plain = decode(q, cache, tables, lens, 0.0625)
    assert torch.equal(decode(q, cache, tables, lens, 0.0625, 0), plain)
    assert torch.equal(decode(q, cache, tables, lens, 0.0625, 70), plain)
    q, cache, table = prefill_case(9, 30, 40, 4, 1, 256, 16)
    for path in ("lanes", "tiled"):
        prefill = cpu_kernels.paged_prefill_attention_on(path)
        plain = prefill(q, cache, table, 30, 0.0625)
        assert torch.equal(prefill(q, cache, table, 30, 0.0625, 0), plain)
        assert torch.equal(prefill(q, cache, table, 30, 0.0625, 70), plain)


@needs_kernel
@pytest.mark.parametrize("window", [3, 16, 20, 77])
def test_a_windowed_prefill_row_attends_alike_in_any_chunk_and_at_any_thread_count(window):
    """As without a window: a row's first key tile is fixed from key 0 and the tiles before its window
    add nothing, so chunking (crossing the two paths) or the thread count never changes its bits."""
    tokens = cpu_kernels.prefill_attention_lane_rows() // 4 + 10  # Gemma 3 270M: 4 rows a query
    q, cache, table = prefill_case(window, 0, tokens, 4, 1, 256, 16)
    attend = cpu_kernels.paged_prefill_attention()
    whole = attend(q, cache, table, 0, 0.0625, window)
    for cuts in ([0, 13, 40, tokens], [0, 1, 2, tokens - 1, tokens], [0, tokens // 2, tokens]):
        chunks = [attend(q[a:b].contiguous(), cache, table, a, 0.0625, window)
                  for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(chunks), whole)
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            assert torch.equal(attend(q, cache, table, 0, 0.0625, window), whole)
            tail = attend(q[-14:].contiguous(), cache, table, tokens - 14, 0.0625, window)
            assert torch.equal(tail, whole[-14:])
    finally:
        torch.set_num_threads(threads)


CAPPED_WINDOWS = """
from pdserve.engine import cpu_kernels
from tests.engine.test_attention_kernels import (
    WINDOWS, WINDOW_SHAPES,
    test_windowed_decode_matches_masked_sdpa_reading_no_row_before_its_window as decode,
    test_windowed_prefill_matches_masked_sdpa_on_both_paths as prefill)
assert cpu_kernels.gemv_isa() == "avx2", cpu_kernels.gemv_isa()
for shape in WINDOW_SHAPES:
    for window in WINDOWS:
        decode(*shape, window)
        prefill(*shape, window)
print("checked")
"""


@needs_kernel
def test_the_windowed_kernels_in_8_lanes_too():
    """The 8-lane build (PDSERVE_CPU_ISA=avx2) under the same windowed checks: its key tiles are half
    as long, so a window starts at another place in them."""
    run_capped_to_avx2(CAPPED_WINDOWS)


@needs_kernel
def test_a_negative_window_is_refused():
    q, cache, tables, lens = paged_case(3, [20, 8], 4, 2, 16, block_size=16)
    with pytest.raises(RuntimeError, match="window must be 0 .no limit. or more, not -1"):
        cpu_kernels.paged_decode_attention()(q, cache, tables, lens, 0.25, -1)
    q, cache, table = prefill_case(4, 0, 3, 4, 2, 16, 16)
    with pytest.raises(RuntimeError, match="window must be 0 .no limit. or more, not -2"):
        cpu_kernels.paged_prefill_attention()(q, cache, table, 0, 0.25, -2)


def test_attention_kernel_names_and_dtypes_are_checked():
    assert select_attention(CPU, "sdpa") is None
    with pytest.raises(ValueError, match="use sdpa, native or triton"):
        select_attention(CPU, "flash")
    with pytest.raises(FieldError, match="attention_kernel must be one of auto, sdpa, native, triton"):
        EngineConfig(attention_kernel="paged")
    with pytest.raises(FieldError, match="attention_kernel must be sdpa or auto with kv_dtype int8"):
        EngineConfig(attention_kernel="native", cache=CacheConfig(kv_dtype="int8"))


KERNEL_PAIRS = [pytest.param("matmul", marks=needs_kernel, id="matmul"),
                pytest.param("native", marks=needs_native, id="native-linear")]
ALONE = {"linear_kernel": "matmul", "pointwise_kernel": "torch"}  # native attention beside torch's kernels


@pytest.mark.parametrize("linear_kernel", KERNEL_PAIRS)
@pytest.mark.parametrize("engine_kwargs",
                         [{}, {"budget": 7}, {"block_size": 8, "num_blocks": 10, "budget": 32}],
                         ids=["batched", "chunked", "preempted"])
def test_native_attention_cache_paths_match_the_reference(tiny_loaded, linear_kernel, engine_kwargs):
    engine = make_engine(tiny_loaded, linear_kernel=linear_kernel, attention_kernel="native",
                         pointwise_kernel="torch", **engine_kwargs)
    check_cache_paths(engine)


@needs_kernel
def test_native_attention_over_many_rows_of_mixed_lengths_matches_the_reference(tiny_loaded):
    """20 sequences decoding together, lengths spread over several blocks: one kernel call per layer,
    each row reading its own blocks, against the reference's SDPA; every prompt's prefill on the
    prefill kernel."""
    g = torch.Generator().manual_seed(99)
    lengths = [1, 70, 5, 33, 17, 64, 2, 48, 9, 81, 16, 40, 3, 57, 25, 12, 90, 7, 31, 44]
    prompts = [torch.randint(0, tiny_loaded.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    engine = make_engine(tiny_loaded, attention_kernel="native", **ALONE)
    decode_rows, prefill_rows = [], []
    kernels = engine.model.paged_attention
    engine.model.paged_attention = dataclasses.replace(
        kernels, decode=lambda q, *rest: decode_rows.append(q.shape[0]) or kernels.decode(q, *rest),
        prefill=lambda q, *rest: prefill_rows.append(q.shape[0]) or kernels.prefill(q, *rest))
    check_against_reference(engine, prompts)
    assert max(decode_rows) == len(lengths)
    assert sum(prefill_rows) == sum(lengths) * tiny_loaded.config.num_layers


@needs_kernel
def test_native_attention_blocks_filled_by_decode_steps_audit_clean(tiny_loaded):
    check_decode_filled_blocks_audit_clean(make_engine(tiny_loaded, attention_kernel="native", budget=40,
                                                       **ALONE))


@needs_kernel
def test_native_attention_greedy_continuation_matches_transformers(tiny_loaded, hf_tiny):
    engine = make_engine(tiny_loaded, attention_kernel="native", block_size=4, budget=16, **ALONE)
    check_greedy_matches_transformers(engine, hf_tiny)


@needs_native
@pytest.mark.slow  # transformers' GGUF load
def test_native_kernels_on_smollm2_match_transformers_within_the_linear_bound(smollm_loaded, hf_smollm):
    """The three native kernels together, the defaults where they build: the linear kernels' bound on the
    logits (attention, norms and SiLU add sums in their own order, not another bound), greedy tokens
    equal."""
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    chat_ids = smollm_loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    engine = make_engine(smollm_loaded, linear_kernel="native", attention_kernel="native",
                         pointwise_kernel="native", block_size=16, num_blocks=64, budget=40)
    with torch.inference_mode():
        diff = (engine.model.reference_logits(chat_ids) - hf_logits(hf_smollm, chat_ids)).abs().max().item()
    assert diff <= ONEDNN_VS_TRANSFORMERS
    [ours] = engine.generate([chat_ids], SamplingParams(temperature=0, max_tokens=24), detokenize=False)
    assert ours.token_ids == hf_greedy(hf_smollm, chat_ids, 24)
    check_against_reference(engine, varied_prompts(smollm_loaded.config.vocab_size)[:6])
