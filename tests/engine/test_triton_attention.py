"""The Triton paged attention (pdserve/engine/triton_attention.py) on the CPU, through Triton's
interpreter (TRITON_INTERPRET=1), against attention_reference.py, itself checked once against the
model's dense SDPA over rows gathered position by position.

Tolerances: 1e-5 (absolute and relative) wherever q is float32, whatever the pool's format: kernel
and reference read the same float32 values from the rows and differ in summation order only; a
float16 or bfloat16 q's output is compared within a few of its dtype's rounding steps.

NOTE: the interpreter runs each program in Python, milliseconds apiece, so the shapes are tiny (head_dim
16 or 32, a KV head or two) and each case is one launch or two.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine import attention_reference as reference
from pdserve.engine import triton_attention
from pdserve.engine.kv_format import KV_FORMATS
from pdserve.engine.model import _context_mask, causal_mask, sdpa_4d
from pdserve.engine.own_rows import with_own_rows

REPO_ROOT = Path(__file__).resolve().parents[2]  # the subprocesses import pdserve and this module from it
BLOCK_SIZE = 16
LENGTHS = [1, 15, 16, 17, 250]  # a block's first row, its last but one, all of it, one over; many blocks
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    """Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET=1 for the whole session, before
    torch (which loads triton where it is installed) and so before triton's library is made: a
    process that imported triton without it cannot interpret."""
    pytest.importorskip("triton")
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert triton_attention.unavailable() is None


def make_cache(kv_dtype: str, num_blocks: int, kv_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """One layer of a pool of random rows, [2, blocks, BLOCK_SIZE, kv_heads, row], as a strided view
    of wider rows (so the kernels must read it through its strides)."""
    fmt = KV_FORMATS[kv_dtype]
    g = torch.Generator().manual_seed(seed)
    rows = fmt.store_rotated(torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=g))
    wide = torch.zeros(*rows.shape[:-1], rows.shape[-1] + 3, dtype=rows.dtype)
    cache = wide[..., :rows.shape[-1]]
    cache.view(torch.uint8).copy_(rows.view(torch.uint8)) if rows.element_size() == 1 else cache.copy_(rows)
    return cache


def shuffled_tables(lengths: list[int], num_blocks: int, seed: int, dtype=torch.int64) -> torch.Tensor:
    """[B, width]: each row's blocks drawn from one permutation of a pool larger than all rows need;
    the entries past a row's context are other valid ids."""
    width = max(-(-n // BLOCK_SIZE) for n in lengths)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    assert num_blocks >= len(lengths) * width
    return order[:len(lengths) * width].view(len(lengths), width).to(dtype)


def decode_case(kv_dtype: str, lengths: list[int], heads: int, kv_heads: int, head_dim: int, seed: int,
                q_dtype=torch.float32, own: bool = False):
    g = torch.Generator().manual_seed(seed + 1)
    num_blocks = len(lengths) * max(-(-n // BLOCK_SIZE) for n in lengths) + 5
    cache = make_cache(kv_dtype, num_blocks, kv_heads, head_dim, seed)
    tables = shuffled_tables(lengths, num_blocks, seed)
    q = torch.randn(len(lengths), heads, head_dim, generator=g).to(q_dtype)
    own_rows = {}
    if own:
        own_rows = {"own_k": torch.randn(len(lengths), kv_heads, head_dim, generator=g),
                    "own_v": torch.randn(len(lengths), kv_heads, head_dim, generator=g)}
    return q, cache, tables, torch.tensor(lengths), own_rows


def assert_close(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert ours.dtype == expected.dtype and ours.shape == expected.shape
    tol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(ours.float(), expected.float(), atol=tol, rtol=tol)


# --- the reference against dense attention -------------------------------------------------------

def dense_rows(cache: torch.Tensor, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [length, KVH, D] float32, row by row through the table."""
    fmt = KV_FORMATS["float32"]
    k = torch.stack([cache[0, int(table[t // BLOCK_SIZE]), t % BLOCK_SIZE] for t in range(length)])
    v = torch.stack([cache[1, int(table[t // BLOCK_SIZE]), t % BLOCK_SIZE] for t in range(length)])
    return fmt.load_rotated(k), fmt.load_rotated(v)


def test_reference_decode_matches_dense_sdpa():
    q, cache, tables, lens, _ = decode_case("float32", [1, 17, 40], 4, 2, 16, seed=3)
    for window in (0, 9):
        ours = reference.paged_decode_attention(q, cache, tables, lens, 0.3, window)
        for b, n in enumerate(lens.tolist()):
            k, v = dense_rows(cache, tables[b], n)
            mask = _context_mask(lens[b:b + 1], n, window or None)[0]  # [1, 1, n]
            expected = sdpa_4d(q[b:b + 1], k, v, mask, False, 0.3)
            torch.testing.assert_close(ours[b:b + 1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("start, window", [(0, 0), (21, 0), (21, 7)])
def test_reference_prefill_matches_dense_sdpa(start, window):
    q, cache, tables, _, _ = decode_case("float32", [start + 13], 6, 2, 16, seed=4)
    q = q.expand(13, -1, -1) * torch.linspace(0.5, 2.0, 13)[:, None, None]  # a query a position
    k, v = dense_rows(cache, tables[0], start + 13)
    expected = sdpa_4d(q, k, v, causal_mask(start, 13, window or None, q.device), False, 0.3)
    ours = reference.paged_prefill_attention(q, cache, tables[0], start, 0.3, window)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_reference_own_rows_match_the_dense_rule():
    """int8's own-row rule as own_rows.with_own_rows states it, densely (prefill), and a decode row as
    the last query of such a chunk."""
    start, tokens = 9, 12
    q, cache, tables, _, _ = decode_case("int8", [start + tokens], 3, 1, 16, seed=5)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(tokens, 3, 16, generator=g)
    own = (torch.randn(tokens, 1, 16, generator=g), torch.randn(tokens, 1, 16, generator=g))
    rows = KV_FORMATS["int8"].load_rotated(
        cache.index_select(1, tables[0]).flatten(1, 2)[:, :start + tokens])
    expected = sdpa_4d(q, *with_own_rows(rows[0], rows[1], own, start), False, 0.3)
    ours = reference.paged_prefill_attention(q, cache, tables[0], start, 0.3, own_k=own[0], own_v=own[1])
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    last = reference.paged_decode_attention(q[-1:], cache, tables, torch.tensor([start + tokens]), 0.3,
                                            own_k=own[0][-1:], own_v=own[1][-1:])
    torch.testing.assert_close(last, expected[-1:], atol=1e-5, rtol=1e-5)


# --- decode ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads, kv_heads, kv_splits, table_dtype", [
    (2, 2, 1, torch.int64), (6, 2, 4, torch.int32), (4, 1, 5, torch.int64), (8, 2, None, torch.int32)],
    ids=["gqa1-one-split", "gqa3-splits", "gqa4-empty-split", "gqa4-default-splits"])
def test_decode_matches_reference(heads, kv_heads, kv_splits, table_dtype):
    """Context lengths around a block's edges and of many blocks, through shuffled tables; GQA ratios
    1, 3 and 4; one split, several, and one past every row's context (width 16 in 5 splits of 4)."""
    q, cache, tables, lens, _ = decode_case("float32", LENGTHS, heads, kv_heads, 32, seed=heads)
    ours = triton_attention.paged_decode_attention(q, cache, tables.to(table_dtype), lens, 0.25,
                                                   kv_splits=kv_splits)
    assert_close(ours, reference.paged_decode_attention(q, cache, tables, lens, 0.25))


@pytest.mark.parametrize("kv_dtype, head_dim", [("float16", 16), ("bfloat16", 16), ("int8", 16), ("fp8", 16),
                                               ("int8", 10), ("fp8", 12)])
def test_decode_matches_reference_in_every_row_format(kv_dtype, head_dim):
    """The quantized formats with float32 queries (int8 with its own rows), the half formats with
    queries of their dtype; head_dims that are no power of two and leave the scales unaligned."""
    q_dtype = KV_FORMATS[kv_dtype].storage_dtype if kv_dtype.endswith("16") else torch.float32
    q, cache, tables, lens, own = decode_case(kv_dtype, [1, 17, 40], 3, 1, head_dim, seed=7, q_dtype=q_dtype,
                                              own=kv_dtype == "int8")
    ours = triton_attention.paged_decode_attention(q, cache, tables, lens, 0.25, kv_splits=3, **own)
    assert_close(ours, reference.paged_decode_attention(q, cache, tables, lens, 0.25, **own))


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_decode_window_matches_reference(kv_dtype):
    q, cache, tables, lens, own = decode_case(kv_dtype, [1, 15, 21, 60], 4, 2, 16, seed=8,
                                              own=kv_dtype == "int8")
    ours = triton_attention.paged_decode_attention(q, cache, tables, lens, 0.25, 20, kv_splits=2, **own)
    expected = reference.paged_decode_attention(q, cache, tables, lens, 0.25, 20, **own)
    assert_close(ours, expected)
    assert not torch.allclose(expected, reference.paged_decode_attention(q, cache, tables, lens, 0.25, **own))


@pytest.mark.parametrize("kv_splits", [1, 3])
def test_decode_context_zero_row_gives_zero_and_leaves_the_others(kv_splits):
    """A static batch's padded row (context 0): output exactly 0, never NaN, and the other rows' bits
    as without it, with one split and with several (the merge's guard)."""
    q, cache, tables, lens, own = decode_case("int8", [0, 17, 33], 3, 1, 16, seed=9, own=True)
    ours = triton_attention.paged_decode_attention(q, cache, tables, lens, 0.25, kv_splits=kv_splits, **own)
    assert torch.equal(ours[0], torch.zeros_like(ours[0]))
    alone = triton_attention.paged_decode_attention(q[1:], cache, tables[1:], lens[1:], 0.25,
                                                    kv_splits=kv_splits,
                                                    own_k=own["own_k"][1:], own_v=own["own_v"][1:])
    assert torch.equal(ours[1:], alone)
    assert_close(ours, reference.paged_decode_attention(q, cache, tables, lens, 0.25, **own))


def test_own_rows_come_in_pairs_of_the_queries_shape():
    q, cache, tables, lens, own = decode_case("int8", [5, 17], 3, 1, 16, seed=4, own=True)
    with pytest.raises(ValueError, match=r"own_k and own_v must both be \(2, 1, 16\)"):
        triton_attention.paged_decode_attention(q, cache, tables, lens, 0.25, own_k=own["own_k"])
    with pytest.raises(ValueError, match="own_k and own_v must both be"):
        triton_attention.paged_decode_attention(q, cache, tables, lens, 0.25, own_k=own["own_k"][:1],
                                                own_v=own["own_v"][:1])


def _no_host_reads(*_args, **_kwargs):
    raise AssertionError("the decode wrapper read a tensor's value on the host")


def test_decode_reads_no_tensor_value_on_the_host(monkeypatch):
    """What a CUDA graph capture forbids: every way Python pulls a tensor's value out (item, tolist,
    int, float, bool, index) raises while the wrapper runs, interpreter included."""
    q, cache, tables, lens, own = decode_case("int8", [5, 40], 3, 1, 16, seed=10, own=True)
    expected = reference.paged_decode_attention(q, cache, tables, lens, 0.25, **own)
    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, _no_host_reads)
    ours = triton_attention.paged_decode_attention(q, cache, tables, lens, 0.25, kv_splits=2, **own)
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="on the host"):  # NOTE: the patch was live: it can fail
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "item", _no_host_reads)
            lens.max().item()
    assert_close(ours, expected)


# --- prefill ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype, start, tokens, heads, kv_heads, window", [
    ("float32", 0, 20, 3, 1, 0), ("float32", 37, 13, 4, 1, 0), ("float32", 3, 30, 2, 2, 11),
    ("bfloat16", 16, 19, 4, 2, 0), ("float16", 5, 9, 2, 1, 4), ("int8", 0, 18, 3, 1, 0),
    ("int8", 21, 30, 4, 2, 7), ("fp8", 40, 17, 6, 2, 0)],
    ids=["fresh-gqa3", "cached-prefix-gqa4", "window-gqa1", "bf16", "f16-window", "int8-fresh",
         "int8-cached-window", "fp8-cached"])
def test_prefill_matches_reference(kv_dtype, start, tokens, heads, kv_heads, window):
    """A fresh chunk and chunks after a cached prefix, token counts that leave a partial query tile,
    windows; int8 with its own rows."""
    q_dtype = KV_FORMATS[kv_dtype].storage_dtype if kv_dtype.endswith("16") else torch.float32
    q, cache, tables, _, _ = decode_case(kv_dtype, [start + tokens], heads, kv_heads, 16, seed=tokens)
    g = torch.Generator().manual_seed(start)
    q = torch.randn(tokens, heads, 16, generator=g).to(q_dtype)
    own = {}
    if kv_dtype == "int8":
        own = {"own_k": torch.randn(tokens, kv_heads, 16, generator=g),
               "own_v": torch.randn(tokens, kv_heads, 16, generator=g)}
    ours = triton_attention.paged_prefill_attention(q, cache, tables[0], start, 0.25, window, **own)
    assert_close(ours, reference.paged_prefill_attention(q, cache, tables[0], start, 0.25, window, **own))


# --- the GPU's compiler ----------------------------------------------------------------------------

def compile_for_h100() -> None:
    """The kernels through Triton's CUDA compiler down to an sm_90 binary, no GPU needed: what the
    interpreter never checks (constexpr typing, tl.dot's shapes on tensor cores' terms, the bitcasts).
    Run in a process of its own, without TRITON_INTERPRET (the decorator would make them interpreted)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pdserve.engine import triton_kernels as kernels

    def compile_one(kernel, pointers: dict[str, str], constexprs: dict) -> None:
        scalars = {"scale": "fp32"}  # every other argument that is no pointer is an int32
        signature = {name: "constexpr" if name in constexprs else {**scalars, **pointers}.get(name, "i32")
                     for name in inspect.signature(kernel.fn).parameters}
        triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32))

    floats = {name: "*fp32" for name in ("own_k_ptr", "own_v_ptr", "lut_ptr", "part_m_ptr", "part_l_ptr",
                                          "part_acc_ptr")}
    compile_one(kernels.decode_kernel,
                {**floats, "q_ptr": "*bf16", "out_ptr": "*bf16", "cache_ptr": "*u8", "table_ptr": "*i32",
                 "lens_ptr": "*i32"},
                dict(BLOCK_SIZE=16, GROUP=3, GROUP_PAD=16, HEAD_DIM=64, BLOCK_D=64, BLOCK_N=64,
                     FORMAT=2, HAS_OWN=False, SPLIT=True))
    compile_one(kernels.decode_reduce_kernel, {**floats, "out_ptr": "*bf16"},
                dict(HEAD_DIM=64, BLOCK_D=64, SPLITS_PAD=8))
    compile_one(kernels.prefill_kernel,
                {**floats, "q_ptr": "*fp32", "out_ptr": "*fp32", "cache_ptr": "*u8", "table_ptr": "*i64"},
                dict(BLOCK_SIZE=16, GROUP=4, GROUP_PAD=4, HEAD_DIM=64, BLOCK_D=64, BLOCK_M=16, BLOCK_N=64,
                     FORMAT=1, HAS_OWN=True))


def test_kernels_compile_for_an_h100(tmp_path):
    """fp8 decode with split-KV and its merge, int8 prefill with own rows, for bfloat16 and float32
    queries: compiled for sm_90 by the ptxas Triton ships (skipped where it ships none)."""
    import triton

    if not list((Path(triton.__file__).parent / "backends" / "nvidia" / "bin").glob("ptxas")):
        pytest.skip("this triton ships no ptxas")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # NOTE: a fresh cache, so it compiles here and now
    code = "from tests.engine.test_triton_attention import compile_for_h100; compile_for_h100()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=env, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-4000:]


# --- availability ----------------------------------------------------------------------------------

def test_imports_and_says_why_without_triton():
    """triton is a dev dependency: the module imports without it and says so."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "from pdserve.engine import triton_attention\n"
            "print(triton_attention.unavailable())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            check=True, cwd=REPO_ROOT)
    assert "triton is not installed" in result.stdout


def test_unavailable_without_a_device_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "TRITON_INTERPRET" in triton_attention.unavailable()
