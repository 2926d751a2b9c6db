"""The native fused pointwise kernel (EngineConfig.pointwise_kernel "native", pdserve/engine/pointwise.cpp).

Each op against torch's (TorchPointwise, bit-equal to transformers): RoPE and the
residual sum bit-equal; the norm and SiLU·up within NORM_REL and SILU_REL (their sums and exp run in
another order), for widths that leave every vector tail and for rows that are views. Then the
engine on it against the no-cache reference (tests/engine/test_exactness.py's assertions and 1e-4)
on every cache path, alone and beside the other native kernels, the KV audit, and transformers'
greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.model import RotaryEmbedding, plain_inverse_frequencies
from pdserve.engine.pointwise import FusedPointwise, TorchPointwise, select_pointwise
from pdserve.field_error import FieldError
from tests.conftest import make_engine
from tests.engine.kernel_checks import (
    check_cache_paths,
    check_decode_filled_blocks_audit_clean,
    check_greedy_matches_transformers,
    needs_kernel,
)
from tests.engine.test_linear_kernels import needs_native

CPU = torch.device("cpu")
NORM_REL = 1e-6  # measured: 3.5e-7 (a few ulp) on rows of 576
SILU_REL = 1e-6  # measured: 3.1e-7

torch_ops = TorchPointwise()


def fused() -> FusedPointwise:
    return select_pointwise(CPU, "native")  # type: ignore[return-value]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs() / want.abs().clamp_min(1e-3)).max().item()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 40, 300])
@pytest.mark.parametrize("width", [576, 64, 13, 8])
def test_norms_match_torch_within_a_few_ulp_and_the_residual_sum_exactly(rows, width):
    g = torch.Generator().manual_seed(rows * width)
    x, residual = torch.randn(rows, width, generator=g) * 3, torch.randn(rows, width, generator=g)
    weight = torch.rand(width, generator=g) + 0.5
    assert rel_err(fused().rms_norm(x, weight, 1e-5), torch_ops.rms_norm(x, weight, 1e-5)) <= NORM_REL
    want_norm, want_sum = torch_ops.add_rms_norm(x, residual, weight, 1e-5)
    got_norm, got_sum = fused().add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    assert torch.equal(got_sum, want_sum)
    assert rel_err(got_norm, want_norm) <= NORM_REL


@needs_kernel
def test_add_rms_norm_works_in_place_and_passes_a_first_residual_through():
    x, residual, weight = torch.randn(5, 24), torch.randn(5, 24), torch.rand(24)
    x_in, residual_in = x.clone(), residual.clone()
    normed, total = fused().add_rms_norm(x_in, residual_in, weight, 1e-5)
    assert normed.data_ptr() == x_in.data_ptr() and total.data_ptr() == residual_in.data_ptr()
    assert torch.equal(total, residual + x)
    embeddings = x.clone()
    normed, total = fused().add_rms_norm(embeddings, None, weight, 1e-5)  # layer 0: the sum is x itself
    assert total is embeddings and torch.equal(embeddings, x)  # untouched: the next layer adds into it
    assert rel_err(normed, torch_ops.rms_norm(x, weight, 1e-5)) <= NORM_REL


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 100])
@pytest.mark.parametrize("width", [1536, 24, 5])
def test_silu_and_mul_matches_torch_within_a_few_ulp(rows, width):
    gate_up = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(width)) * 4
    assert rel_err(fused().silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up)) <= SILU_REL


@needs_kernel
def test_silu_at_the_ends_of_float_range_rounds_as_torch():
    gate = torch.tensor([-1e30, -200.0, -90.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0, 90.0, 1e30])
    gate_up = torch.cat([gate, torch.full_like(gate, 2.0)]).view(1, -1)
    got, want = fused().silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up)
    assert torch.allclose(got, want, rtol=SILU_REL, atol=1e-30)


@needs_kernel
@pytest.mark.parametrize("heads, head_dim", [(12, 64), (3, 16), (2, 10), (1, 2)])
def test_rotary_is_bit_equal_to_torch_and_leaves_the_other_columns(heads, head_dim):
    tokens, extra = 37, 2 * head_dim  # extra: the v columns after the rotated heads
    rope = RotaryEmbedding(plain_inverse_frequencies(head_dim, 100000.0), 4096, CPU)
    rot = rope.at(torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(head_dim)))
    qkv = torch.randn(tokens, heads * head_dim + extra)
    want = torch_ops.rotary(qkv, rot, heads, head_dim)
    got_qkv = qkv.clone()
    got = fused().rotary(got_qkv, rot, heads, head_dim)
    assert torch.equal(got, want)
    assert torch.equal(got_qkv[:, heads * head_dim:], qkv[:, heads * head_dim:])


@needs_kernel
def test_a_row_that_is_a_view_is_read_where_it_lies():
    wide = torch.randn(6, 40)
    x = wide[:, 4:28]  # rows of 24, 40 apart
    weight = torch.rand(24)
    assert rel_err(fused().rms_norm(x, weight, 1e-5), torch_ops.rms_norm(x, weight, 1e-5)) <= NORM_REL
    assert rel_err(fused().silu_and_mul(x), torch_ops.silu_and_mul(x)) <= SILU_REL


@needs_kernel
def test_a_row_gets_the_same_bits_alone_and_among_many_at_any_thread_count():
    x, weight = torch.randn(257, 576), torch.rand(576)
    gate_up = torch.randn(257, 512)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = fused().rms_norm(x[100:101], weight, 1e-5), fused().silu_and_mul(gate_up[100:101])
        torch.set_num_threads(2)
        many = fused().rms_norm(x, weight, 1e-5)[100:101], fused().silu_and_mul(gate_up)[100:101]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone[0], many[0]) and torch.equal(alone[1], many[1])


@needs_kernel
def test_bad_shapes_are_refused_by_name():
    ops = torch.ops.pdserve
    with pytest.raises(RuntimeError, match=r"rms_norm: weight \[8\] float32"):
        ops.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="silu_and_mul: gate_up's width 5 is odd"):
        ops.silu_and_mul(torch.ones(2, 5))
    with pytest.raises(RuntimeError, match="rotary_: 3 heads of 4 do not fit rows of 10"):
        ops.rotary_(torch.ones(2, 10), torch.ones(2, 4), torch.ones(2, 4), 3, 4)
    with pytest.raises(RuntimeError, match="add_rms_norm_: residual"):
        ops.add_rms_norm_(torch.ones(2, 8), torch.ones(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.rms_norm(torch.ones(8, 2).t(), torch.ones(8), 1e-5)


def test_pointwise_kernel_names_are_checked():
    with pytest.raises(FieldError, match="pointwise_kernel must be one of auto, torch, native"):
        EngineConfig(pointwise_kernel="fused")
    with pytest.raises(ValueError, match="use torch or native"):
        select_pointwise(CPU, "fused")
    with pytest.raises(ValueError, match="CPU only"):
        select_pointwise(torch.device("meta"), "native")
    assert isinstance(select_pointwise(CPU), TorchPointwise) and select_pointwise(CPU).name == "torch"


ALONE = {"linear_kernel": "matmul", "attention_kernel": "sdpa"}  # the fused kernel beside torch's kernels
KERNEL_SETS = [pytest.param(ALONE, marks=needs_kernel, id="pointwise-only"),
               pytest.param({"linear_kernel": "native", "attention_kernel": "native"}, marks=needs_native,
                            id="all-native")]


@pytest.mark.parametrize("kernels", KERNEL_SETS)
@pytest.mark.parametrize("engine_kwargs",
                         [{}, {"budget": 7}, {"block_size": 8, "num_blocks": 10, "budget": 32}],
                         ids=["batched", "chunked", "preempted"])
def test_fused_pointwise_cache_paths_match_the_reference(tiny_loaded, kernels, engine_kwargs):
    engine = make_engine(tiny_loaded, pointwise_kernel="native", **kernels, **engine_kwargs)
    assert isinstance(engine.model.pointwise, FusedPointwise)
    check_cache_paths(engine)


@needs_kernel
def test_fused_pointwise_blocks_filled_by_decode_steps_audit_clean(tiny_loaded):
    check_decode_filled_blocks_audit_clean(make_engine(tiny_loaded, pointwise_kernel="native", budget=40,
                                                       **ALONE))


@needs_kernel
def test_fused_pointwise_greedy_continuation_matches_transformers(tiny_loaded, hf_tiny):
    engine = make_engine(tiny_loaded, pointwise_kernel="native", block_size=4, budget=16, **ALONE)
    check_greedy_matches_transformers(engine, hf_tiny)
