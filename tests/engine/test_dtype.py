"""The model's dtype (EngineConfig.dtype) and the KV cache's (cache.kv_dtype) as the engine resolves them,
and a bfloat16 model on the CPU held to its own no-cache reference.

auto is bfloat16 on CUDA and float32 on the CPU; kv_dtype auto is the model's. A bfloat16 model runs
torch's kernels on the CPU (the native ones read float32 only), and every cache path attends the
rows it loads in the query's dtype, so its greedy tokens are DecoderModel.reference_logits's at
bfloat16, exactly, as float32's are at float32 (tests/engine/test_exactness.py).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from pdserve.engine.audit import KVAuditor
from pdserve.engine.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    resolve_kv_dtype,
    resolve_model_dtype,
)
from pdserve.engine.kernel_choice import KernelSupport, choose_kernels
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.pointwise import TorchPointwise
from pdserve.engine.sequence import SamplingParams
from pdserve.engine.tiny_model import TINY_ARCHS
from pdserve.field_error import FieldError
from tests.conftest import assert_no_leaks
from tests.engine.test_exactness import MAX_TOKENS, capture_logits, reference_rows, varied_prompts

# NOTE: a batch of another shape (a prefix hit, a chunk, other requests) runs torch's bfloat16 matmul at
# another row count, which sums in another order: a logit moves by a bfloat16 step of the row's largest
# logit (0.03125 near the tiny model's logits of 4; measured at most one step on its prompts, two on
# qwen3's tiny model), and the tiny random models' bfloat16 logits tie often (the top
# two are often equal). So each token is compared with the reference's argmax where the reference's
# top two are CLEAR_STEPS steps apart, and elsewhere must be a token the reference puts within the
# tolerance of its top; logits stay within TOLERANCE_STEPS steps at every step.
TOLERANCE_STEPS = 4
CLEAR_STEPS = 2 * TOLERANCE_STEPS
MIN_CLEAR_STEPS = 8  # of 80 per run on the llama tiny model: about 20 were clear when measured


def bfloat16_step(logits: torch.Tensor) -> float:
    """The spacing of bfloat16 values at the row's largest magnitude: 2^-7 of its power of two."""
    return 2.0 ** (math.floor(math.log2(float(logits.abs().max()))) - 7)


# --- resolution: pure ------------------------------------------------------------------------------

@pytest.mark.parametrize(("requested", "device", "value", "reason"), [
    ("auto", "cpu", "float32", "auto: cpu"),
    ("auto", "cuda", "bfloat16", "auto: cuda"),
    ("float16", "cuda", "float16", "set: dtype float16"),
    ("float32", "cuda", "float32", "set: dtype float32"),
    ("bfloat16", "cpu", "bfloat16", "set: dtype bfloat16"),
])
def test_model_dtype_resolves_per_device_and_keeps_an_explicit_one(requested, device, value, reason):
    choice = resolve_model_dtype(requested, device)
    assert (choice.value, choice.reason) == (value, reason)
    assert choice.describe() == f"dtype {value} ({reason})"


@pytest.mark.parametrize(("requested", "model_dtype", "value"), [
    ("auto", "float32", "float32"), ("auto", "bfloat16", "bfloat16"), ("auto", "float16", "float16"),
    ("int8", "bfloat16", "int8"), ("float32", "bfloat16", "float32"),
])
def test_kv_dtype_auto_is_the_models_and_an_explicit_one_is_kept(requested, model_dtype, value):
    choice = resolve_kv_dtype(requested, model_dtype)
    assert choice.value == value
    expected = "auto: the model's dtype" if requested == "auto" else f"set: kv_dtype {requested}"
    assert choice.reason == expected


@pytest.mark.parametrize(("device", "dtype", "kv_dtype"), [("cpu", "float32", "float32"),
                                                            ("cuda", "bfloat16", "bfloat16")])
def test_the_defaults_resolve_to_concrete_dtypes_before_anything_reads_them(device, dtype, kv_dtype):
    config, choices = EngineConfig().resolved(device)
    assert (config.dtype, config.cache.kv_dtype) == (dtype, kv_dtype)
    assert [c.value for c in choices] == [dtype, kv_dtype]
    assert EngineConfig().cache.kv_dtype == "auto" and EngineConfig().dtype == "auto"


def test_an_explicit_native_kernel_with_bfloat16_fails_naming_the_field():
    for setting in ("linear_kernel", "attention_kernel", "pointwise_kernel"):
        with pytest.raises(FieldError, match="reads float32 only") as error:
            EngineConfig(dtype="bfloat16", **{setting: "native"})
        assert error.value.field == setting
    with pytest.raises(FieldError, match="reads float32 only"):
        EngineConfig(dtype="bfloat16", linear_kernel="onednn")


def test_native_attention_with_kv_dtype_auto_is_checked_once_resolved():
    native = EngineConfig(attention_kernel="native")  # kv_dtype auto: not refused before it is known
    assert native.resolved("cpu")[0].cache.kv_dtype == "float32"
    with pytest.raises(FieldError, match="native with dtype bfloat16") as error:
        native.resolved("cuda")  # auto: bfloat16 there
    assert error.value.field == "attention_kernel"


# --- the kernels' reasons: pure ---------------------------------------------------------------------

def test_auto_picks_torchs_kernels_for_a_bfloat16_model_on_the_cpu_and_says_why():
    support = KernelSupport("cpu", "AVX512", None, "bfloat16", dtype="bfloat16")
    choices = choose_kernels("auto", "auto", "auto", support)
    assert [c.kernel for c in choices.all()] == ["matmul", "sdpa", "torch"]
    for choice in choices.all():
        assert choice.reason == "auto: dtype bfloat16: the native kernels read float32 only"
    float32 = choose_kernels("auto", "auto", "auto", KernelSupport("cpu", "AVX512", None, "float32"))
    assert [c.kernel for c in float32.all()] == ["native", "native", "native"]


def test_the_kernel_line_names_the_resolved_dtypes_first():
    _, dtypes = EngineConfig().resolved("cuda")
    choices = replace(choose_kernels("auto", "sdpa", "auto", KernelSupport("cuda", "AVX512", None, "bfloat16",
                                                                           dtype="bfloat16")), dtypes=dtypes)
    assert choices.describe().startswith("dtype bfloat16 (auto: cuda); kv_dtype bfloat16 (auto: the model's "
                                         "dtype); linear matmul (auto: the device is cuda")
    assert len(choices.all()) == 3  # what a worker's Status reports as kernels


# --- a bfloat16 engine on the CPU ------------------------------------------------------------------

def bfloat16_engine(loaded, *, budget: int = 2048, num_blocks: int = 256, block_size: int = 16,
                    kv_dtype: str = "auto") -> LLMEngine:
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_dtype=kv_dtype)
    scheduler = SchedulerConfig(max_num_batched_tokens=budget)
    return LLMEngine(loaded, EngineConfig(cache=cache, scheduler=scheduler, device="cpu", dtype="bfloat16"))


def test_a_bfloat16_engine_on_the_cpu_resolves_and_says_why(tiny_loaded):
    engine = bfloat16_engine(tiny_loaded)
    assert (engine.config.dtype, engine.config.cache.kv_dtype) == ("bfloat16", "bfloat16")
    assert engine.kv_cache.dtype == torch.bfloat16
    assert engine.model.lm_head.dtype == torch.bfloat16
    described = engine.kernels.describe()
    assert described.startswith("dtype bfloat16 (set: dtype bfloat16); kv_dtype bfloat16 (auto: the model's "
                                "dtype); linear matmul (")
    if engine.kernels.linear.reason.startswith("auto: dtype"):  # the extension is built: dtype is the reason
        assert "auto: dtype bfloat16: the native kernels read float32 only" in described
    assert [c.kernel for c in engine.kernels.all()] == ["matmul", "sdpa", "torch"]


def check_bfloat16_against_reference(engine: LLMEngine, prompts: list[list[int]],
                                     min_clear: int = MIN_CLEAR_STEPS) -> None:
    """Every step of every request against the reference's row for it (module NOTE above)."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    rows = capture_logits(engine)
    results = engine.generate(prompts, greedy, detokenize=False)
    clear = 0
    for prompt, result in zip(prompts, results, strict=True):
        refs = reference_rows(engine, prompt, result.token_ids)
        assert refs.dtype == torch.float32 and len(rows[result.request_id]) == len(result.token_ids)
        for step, (token, row, ref) in enumerate(zip(result.token_ids, rows[result.request_id], refs)):
            where = f"prompt of {len(prompt)} tokens, step {step}"
            tolerance = TOLERANCE_STEPS * bfloat16_step(ref)
            assert (row - ref).abs().max().item() <= tolerance, where
            top = torch.topk(ref, 2)
            if top.values[0] - top.values[1] >= CLEAR_STEPS * bfloat16_step(ref):
                assert token == int(top.indices[0]), f"{where}: diverged"
                clear += 1
            else:
                assert ref[token] >= top.values[0] - tolerance, f"{where}: not one of the reference's top"
    assert clear >= min_clear
    assert_no_leaks(engine)


@pytest.mark.parametrize("kv_dtype", ["auto", "float32", "int8"])
def test_a_bfloat16_model_matches_its_no_cache_reference(tiny_loaded, kv_dtype):
    """Batched, then again on prefix hits, then chunked under a small budget: greedy tokens equal the
    bfloat16 reference's argmax (a float32 or int8 pool is attended as the reference attends it)."""
    prompts = varied_prompts(tiny_loaded.config.vocab_size)
    engine = bfloat16_engine(tiny_loaded, kv_dtype=kv_dtype)
    check_bfloat16_against_reference(engine, prompts)
    check_bfloat16_against_reference(engine, prompts)  # prefix hits
    check_bfloat16_against_reference(bfloat16_engine(tiny_loaded, budget=7, kv_dtype=kv_dtype), prompts)


def test_the_float32_path_is_unchanged_by_the_dtype_setting(tiny_loaded):
    """dtype float32 set explicitly gives the very logits of the default on the CPU (auto: float32)."""
    prompt = varied_prompts(tiny_loaded.config.vocab_size)[5]
    explicit = CacheConfig(num_blocks=64, kv_dtype="float32")
    configs = [EngineConfig(device="cpu", cache=CacheConfig(num_blocks=64)),
               EngineConfig(device="cpu", dtype="float32", cache=explicit)]
    logits = []
    for config in configs:
        engine = LLMEngine(tiny_loaded, config)
        with torch.inference_mode():
            logits.append(engine.model.reference_logits(prompt, engine.config.cache.kv_dtype))
    assert torch.equal(logits[0], logits[1])
    assert logits[0].dtype == torch.float32


@pytest.mark.parametrize("kv_dtype", ["auto", "float32"])
def test_a_bfloat16_models_cache_audits_clean(tiny_loaded, kv_dtype):
    """The KV audit's recompute runs at other batch shapes: its rule allows the model dtype's rounding
    step too (a float32 pool of a bfloat16 model), so a sound cache is never evicted."""
    engine = bfloat16_engine(tiny_loaded, budget=7, kv_dtype=kv_dtype)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.generate(varied_prompts(tiny_loaded.config.vocab_size), greedy, detokenize=False)
    report = KVAuditor(engine).audit()
    assert report.checked > 0 and report.mismatched == 0, report
    assert_no_leaks(engine)


def test_a_bfloat16_rms_norm_is_transformers_in_both_orders():
    """Llama's norm rounds the normed row, then scales it; Gemma's scales it by 1 + w in float32, then
    rounds (the model keeps Gemma's scale in float32 for that): bit-equal to transformers' modules."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 64, generator=g) * 3).bfloat16()
    w = torch.randn(64, generator=g).bfloat16()
    llama, gemma = LlamaRMSNorm(64, eps=1e-6).bfloat16(), Gemma3RMSNorm(64, eps=1e-6).bfloat16()
    with torch.no_grad():
        llama.weight.copy_(w)
        gemma.weight.copy_(w)
        ours = TorchPointwise()
        assert torch.equal(ours.rms_norm(x, w, 1e-6), llama(x))
        assert torch.equal(ours.rms_norm(x, 1.0 + w.float(), 1e-6), gemma(x))


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_every_family_runs_in_bfloat16_against_its_reference(family_model, arch):
    """Each family's parts (biases, q/k norms, Gemma's float32 norm scales, windows) in bfloat16."""
    _, loaded = family_model(arch)
    engine = bfloat16_engine(loaded, budget=7)
    check_bfloat16_against_reference(engine, varied_prompts(loaded.config.vocab_size)[:6], min_clear=4)
