"""The matmul kernels other than torch's (EngineConfig.linear_kernel "onednn" and "native") under the
exactness suite, each named explicitly; and pdserve's GEMV and panel matmul operators.

Against the no-cache reference on the same kernel: the suite's own assertions and 1e-4 tolerance
(tests/engine/test_exactness.py), every cache path. Against transformers, which runs MKL: greedy
tokens identical, and logits within ONEDNN_VS_TRANSFORMERS (oneDNN and pdserve's panels sum in other
orders; the matmul kernel meets test_oracle.py's 1e-4). native's reference runs its prompts as
products of many rows while its decode steps run one row each: the same panels, whose every row is a
function of that row alone.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve.engine import cpu_kernels
from pdserve.engine.config import EngineConfig
from pdserve.engine.linear import (
    MatmulLinear,
    NativeLinear,
    OneDNNLinear,
    PanelWeight,
    onednn_available,
    select_linear,
)
from pdserve.engine.sequence import SamplingParams
from pdserve.field_error import FieldError
from tests.conftest import make_engine
from tests.engine.kernel_checks import (
    check_cache_paths,
    check_decode_filled_blocks_audit_clean,
    check_greedy_matches_transformers,
    run_capped_to_avx2,
)
from tests.engine.test_exactness import check_against_reference, varied_prompts
from tests.engine.test_oracle import hf_greedy, hf_logits

# max-abs logits on the SmolLM2 chat prompt: 1.1e-4 measured; up to 5e-3 seen on random-id prompts
ONEDNN_VS_TRANSFORMERS = 1e-3

needs_onednn = pytest.mark.skipif(not onednn_available(torch.device("cpu")),
                                  reason="this torch build has no oneDNN linear on this CPU")
needs_native = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                  reason=f"native kernel: {cpu_kernels.unavailable()}")
FAST_KERNELS = [pytest.param("onednn", marks=needs_onednn), pytest.param("native", marks=needs_native)]


def kernel_engine(loaded, kernel, **kwargs):
    """An engine on the linear kernel `kernel`, beside torch's attention and pointwise kernels."""
    return make_engine(loaded, linear_kernel=kernel, attention_kernel="sdpa", pointwise_kernel="torch",
                       **kwargs)


def test_kernel_names_are_checked():
    assert isinstance(select_linear(torch.device("cpu"), "matmul"), MatmulLinear)
    with pytest.raises(ValueError, match="use matmul, onednn or native"):
        select_linear(torch.device("cpu"), "mkl")
    with pytest.raises(FieldError, match="linear_kernel"):
        EngineConfig(linear_kernel="fast")


@needs_onednn
def test_onednn_computes_the_same_products_as_matmul():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(14, 576, generator=g), torch.randn(960, 576, generator=g)
    ours = OneDNNLinear()(x, OneDNNLinear().prepare(w))
    assert torch.allclose(ours, MatmulLinear()(x, MatmulLinear().prepare(w)), atol=1e-4, rtol=1e-5)


GEMV_ROWS = [1, 2, 3, 4, 5, 6, 7, 14, 32]
GEMV_SHAPES = {"qkv": (576, 960), "down": (1536, 576), "tails": (37, 10), "under-one-group": (8, 3)}


def check_gemv_products(gemv, rows: int, n_in: int, n_out: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + n_in)
    x, w = torch.randn(rows, n_in, generator=g), torch.randn(n_out, n_in, generator=g)
    ours = gemv(x, w)
    assert ours.shape == (rows, n_out)
    assert torch.allclose(ours, x.double().mm(w.double().t()).float(), atol=1e-4, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("rows", GEMV_ROWS)
@pytest.mark.parametrize("n_in, n_out", GEMV_SHAPES.values(), ids=GEMV_SHAPES.keys())
def test_gemv_computes_the_same_products_as_matmul(rows, n_in, n_out):
    """Row counts that leave each remainder of its blocks of rows of x (3 with AVX2, 6 with
    AVX-512), the most it serves, and shapes whose rows and columns leave tails (not whole groups of
    4 output rows, nor whole vectors of input)."""
    check_gemv_products(cpu_kernels.gemv(), rows, n_in, n_out)


@needs_native
def test_gemv_runs_avx512_where_the_cpu_has_it():
    expected = "avx512" if torch.backends.cpu.get_cpu_capability() == "AVX512" else "avx2"
    assert cpu_kernels.gemv_isa() == expected


CAPPED_TO_AVX2 = """
import torch
from pdserve.engine import cpu_kernels
from tests.engine.test_linear_kernels import GEMV_ROWS, GEMV_SHAPES, check_gemv_products
assert cpu_kernels.gemv_isa() == "avx2", cpu_kernels.gemv_isa()
for rows in GEMV_ROWS:
    for n_in, n_out in GEMV_SHAPES.values():
        check_gemv_products(cpu_kernels.gemv(), rows, n_in, n_out)
print("checked")
"""


@needs_native
def test_gemv_capped_to_avx2_computes_the_same_products():
    """PDSERVE_CPU_ISA=avx2 runs the AVX2 path on an AVX-512 CPU too: where this machine has AVX-512,
    the other path is checked here."""
    run_capped_to_avx2(CAPPED_TO_AVX2)


@needs_native
def test_an_unknown_cpu_isa_cap_is_refused_by_name():
    env = {**os.environ, "PDSERVE_CPU_ISA": "sse4"}
    code = "from pdserve.engine import cpu_kernels; cpu_kernels.gemv_isa()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "PDSERVE_CPU_ISA is 'sse4': set it to avx2 or avx512, or leave it unset" in done.stderr


@needs_native
def test_native_runs_the_panels_at_every_row_count_from_one_copy_of_the_weight():
    linear = select_linear(torch.device("cpu"), "native")
    assert isinstance(linear, NativeLinear)
    g = torch.Generator().manual_seed(9)
    w = torch.randn(70, 48, generator=g)
    prepared = linear.prepare(w)
    columns = prepared.panels.shape[2]
    assert isinstance(prepared, PanelWeight) and prepared.out == 70
    assert prepared.panels.shape == (-(-70 // columns), 48, columns)  # W's values, padded to whole panels
    for rows in (1, 2, 14, 300):
        x = torch.randn(rows, 48, generator=g)
        assert torch.allclose(linear(x, prepared), x @ w.t(), atol=1e-4, rtol=1e-5)


@needs_native
def test_native_reads_a_weights_rows_back_out_of_its_panels_exactly():
    """A tied model's embedding lookup reads its lm_head's panels (pdserve/engine/model.py)."""
    linear = select_linear(torch.device("cpu"), "native")
    w = torch.randn(70, 48, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([0, 1, 31, 32, 69, 5, 5])  # panel edges, the padded last panel, a repeat
    assert torch.equal(linear.rows(linear.prepare(w), ids), w[ids])


PANEL_ROWS = [1, 2, 5, 6, 7, 13, 14, 15, 29, 64, 300]
PANEL_SHAPES = {"qkv": (576, 960), "down": (1536, 576), "tails": (37, 10), "under-one-panel": (5, 3),
                "lm_head-like": (64, 4097)}


def check_panel_products(panel, rows: int, n_in: int, n_out: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + n_in)
    x, w = torch.randn(rows, n_in, generator=g), torch.randn(n_out, n_in, generator=g)
    ours = panel(x, panel.pack(w), n_out)
    assert ours.shape == (rows, n_out)
    assert torch.allclose(ours, x.double().mm(w.double().t()).float(), atol=1e-4, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("rows", PANEL_ROWS)
@pytest.mark.parametrize("n_in, n_out", PANEL_SHAPES.values(), ids=PANEL_SHAPES.keys())
def test_panel_matmul_computes_the_same_products_as_matmul(rows, n_in, n_out):
    """Row counts that fill, split or leave a tail of its blocks of rows (14 on AVX-512, 6 on AVX2),
    and outputs that are not a whole number of panels."""
    check_panel_products(cpu_kernels.panel_matmul(), rows, n_in, n_out)


@needs_native
def test_a_panel_row_does_not_depend_on_the_rows_beside_it_or_the_threads():
    """Each output is one sum over the input, in order, whatever block its row falls in."""
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(40, 576, generator=g), torch.randn(960, 576, generator=g)
    panel = cpu_kernels.panel_matmul()
    panels = panel.pack(w)
    together = panel(x, panels, 960)
    for i in (0, 13, 14, 39):
        assert torch.equal(panel(x[i:i + 1].contiguous(), panels, 960)[0], together[i])
    assert torch.equal(panel(x[5:33].contiguous(), panels, 960), together[5:33])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(panel(x, panels, 960), together)
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_panel_matmul_refuses_panels_that_do_not_fit_the_output():
    panel = cpu_kernels.panel_matmul()
    panels = panel.pack(torch.randn(40, 8))
    with pytest.raises(RuntimeError, match="panels cannot hold 400 columns"):
        panel(torch.randn(2, 8), panels, 400)


CAPPED_PANELS = """
from pdserve.engine import cpu_kernels
from tests.engine.test_linear_kernels import PANEL_ROWS, PANEL_SHAPES, check_panel_products
assert cpu_kernels.gemv_isa() == "avx2", cpu_kernels.gemv_isa()
for rows in PANEL_ROWS:
    for n_in, n_out in PANEL_SHAPES.values():
        check_panel_products(cpu_kernels.panel_matmul(), rows, n_in, n_out)
print("checked")
"""


@needs_native
def test_panel_matmul_capped_to_avx2_computes_the_same_products():
    """The 8-lane build, run here with PDSERVE_CPU_ISA=avx2."""
    run_capped_to_avx2(CAPPED_PANELS)


@needs_onednn
@pytest.mark.parametrize("rows", [2, 9, 14, 32, 128, 700])
def test_packing_the_weight_for_onednn_changes_no_value(rows):
    """OneDNNLinear.prepare packs W into oneDNN's blocked layout once; given W as stored, oneDNN
    reorders it in the call. The two give the same bits from two rows up (at one row, given W as
    stored, oneDNN runs a GEMV path of its own that sums in another order)."""
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=g), torch.randn(1536, 576, generator=g)
    onednn = OneDNNLinear()
    assert torch.equal(onednn(x, onednn.prepare(w)), onednn(x, w))


@needs_native
def test_a_gemv_row_does_not_depend_on_the_rows_beside_it():
    """Each output is its own register's sum in a fixed order, whatever blocking its row count takes."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(14, 576, generator=g), torch.randn(960, 576, generator=g)
    together = cpu_kernels.gemv()(x, w)
    for i in range(14):
        assert torch.equal(cpu_kernels.gemv()(x[i:i + 1].contiguous(), w)[0], together[i])


@needs_native
def test_native_takes_a_row_that_is_a_view():
    """A decode row arrives as a slice of a wider tensor; the kernel is given it contiguous."""
    g = torch.Generator().manual_seed(3)
    wide, w = torch.randn(3, 96, generator=g), torch.randn(16, 48, generator=g)
    x = wide[:, ::2]
    linear = select_linear(torch.device("cpu"), "native")
    assert torch.allclose(linear(x, linear.prepare(w)), x @ w.t(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kernel", FAST_KERNELS)
@pytest.mark.parametrize("engine_kwargs",
                         [{}, {"budget": 7}, {"block_size": 8, "num_blocks": 10, "budget": 32}],
                         ids=["batched", "chunked", "preempted"])
def test_fast_kernel_cache_paths_match_the_reference(tiny_loaded, kernel, engine_kwargs):
    check_cache_paths(kernel_engine(tiny_loaded, kernel, **engine_kwargs))


@pytest.mark.parametrize("kernel", FAST_KERNELS)
def test_fast_kernel_blocks_filled_by_decode_steps_audit_clean(tiny_loaded, kernel):
    """Decode steps (products of one row) fill whole blocks beside prefill chunks; the KV audit
    recomputes each as one prefill (products of many rows): the rows agree across the row counts."""
    check_decode_filled_blocks_audit_clean(kernel_engine(tiny_loaded, kernel, budget=40))


@pytest.mark.parametrize("kernel", FAST_KERNELS)
def test_fast_kernel_greedy_continuation_matches_transformers(tiny_loaded, hf_tiny, kernel):
    check_greedy_matches_transformers(kernel_engine(tiny_loaded, kernel, block_size=4, budget=16), hf_tiny)


@pytest.mark.parametrize("kernel", FAST_KERNELS)
@pytest.mark.slow  # transformers' GGUF load
def test_fast_kernel_smollm2_matches_transformers_within_its_bound(smollm_loaded, hf_smollm, kernel):
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    chat_ids = smollm_loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    engine = kernel_engine(smollm_loaded, kernel, block_size=16, num_blocks=64, budget=40)
    with torch.inference_mode():
        diff = (engine.model.reference_logits(chat_ids) - hf_logits(hf_smollm, chat_ids)).abs().max().item()
    assert diff <= ONEDNN_VS_TRANSFORMERS
    [ours] = engine.generate([chat_ids], SamplingParams(temperature=0, max_tokens=24), detokenize=False)
    assert ours.token_ids == hf_greedy(hf_smollm, chat_ids, 24)
    check_against_reference(engine, varied_prompts(smollm_loaded.config.vocab_size)[:6])
