"""EngineConfig's kernel settings: auto resolved against fakes of the machine
(pdserve/engine/kernel_choice.py), the old name avx2 taken as native, and an engine built on auto
saying what it chose and why."""

from __future__ import annotations

import pytest

from pdserve.engine.config import (
    ATTENTION_KERNELS,
    LINEAR_KERNELS,
    POINTWISE_KERNELS,
    CacheConfig,
    EngineConfig,
    normalize_kernel,
)
from pdserve.engine.kernel_choice import KernelChoice, KernelSupport, choose_kernels
from pdserve.field_error import FieldError
from tests.engine.kernel_checks import needs_kernel

AVX512_BUILT = KernelSupport("cpu", "AVX512", None, "float32")


def kinds(choices) -> tuple[str, str, str]:
    return tuple(choice.kernel for choice in choices.all())


def test_auto_is_every_kernel_settings_default():
    config = EngineConfig()
    assert (config.linear_kernel, config.attention_kernel, config.pointwise_kernel) == ("auto",) * 3
    assert all(kernels[0] == "auto" for kernels in (LINEAR_KERNELS, ATTENTION_KERNELS, POINTWISE_KERNELS))


def test_auto_picks_native_on_a_cpu_where_the_extension_is_built():
    choices = choose_kernels("auto", "auto", "auto", AVX512_BUILT)
    assert kinds(choices) == ("native", "native", "native")
    assert choices.linear == KernelChoice("linear", "native", "auto: AVX-512 CPU, extension built")
    avx2 = choose_kernels("auto", "auto", "auto", KernelSupport("cpu", "AVX2", None, "float32"))
    assert avx2.pointwise.reason == "auto: AVX2 CPU, extension built"


def test_auto_falls_back_to_torchs_kernels_where_the_extension_is_not_built():
    support = KernelSupport("cpu", "DEFAULT", "this CPU has no AVX2 (torch reports DEFAULT)", "float32")
    choices = choose_kernels("auto", "auto", "auto", support)
    assert kinds(choices) == ("matmul", "sdpa", "torch")
    assert choices.attention.reason == ("auto: extension not built: this CPU has no AVX2 "
                                        "(torch reports DEFAULT)")


def test_auto_on_cuda_runs_triton_attention_and_torchs_other_kernels():
    for kv_dtype in ("bfloat16", "int8"):
        support = KernelSupport("cuda", "AVX512", None, kv_dtype, None)
        choices = choose_kernels("auto", "auto", "auto", support)
        assert kinds(choices) == ("matmul", "triton", "torch")
        assert choices.attention.reason == "auto: cuda, Triton's paged kernels"
    assert choices.linear.reason == "auto: the device is cuda, the native kernels run on CPUs only"


def test_auto_on_cuda_without_triton_falls_back_to_sdpa_and_says_why():
    support = KernelSupport("cuda", "AVX512", None, "bfloat16", "triton is not installed")
    choices = choose_kernels("auto", "auto", "auto", support)
    assert kinds(choices) == ("matmul", "sdpa", "torch")
    assert choices.attention.reason == "auto: cuda, but Triton cannot run: triton is not installed"


def test_the_cpu_never_picks_triton_by_itself():
    choices = choose_kernels("auto", "auto", "auto", KernelSupport("cpu", "AVX512", None, "int8", None))
    assert choices.attention.kernel == "sdpa"
    assert choose_kernels("auto", "triton", "auto", AVX512_BUILT).attention.describe() == (
        "attention triton (set: attention_kernel triton)")


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "float16", "bfloat16"])
def test_auto_attention_takes_sdpa_for_a_kv_dtype_the_native_kernel_cannot_read(kv_dtype):
    choices = choose_kernels("auto", "auto", "auto", KernelSupport("cpu", "AVX512", None, kv_dtype))
    assert kinds(choices) == ("native", "sdpa", "native")
    assert choices.attention.reason == (f"auto: kv_dtype {kv_dtype}: the native attention reads "
                                        "float32 K/V rows only")


def test_an_explicit_setting_is_kept_whatever_the_machine():
    support = KernelSupport("cpu", "DEFAULT", "no compiler", "float32")
    choices = choose_kernels("onednn", "native", "torch", support)
    assert kinds(choices) == ("onednn", "native", "torch")
    assert choices.attention.reason == "set: attention_kernel native"
    assert choices.describe() == ("linear onednn (set: linear_kernel onednn); attention native (set: "
                                  "attention_kernel native); pointwise torch (set: pointwise_kernel torch)")


def test_avx2_is_taken_as_native_where_the_config_is_built():
    assert normalize_kernel("avx2") == "native" and normalize_kernel("sdpa") == "sdpa"
    config = EngineConfig(linear_kernel="avx2", attention_kernel="avx2", pointwise_kernel="avx2")
    assert (config.linear_kernel, config.attention_kernel, config.pointwise_kernel) == ("native",) * 3


def test_an_unknown_kernel_is_refused_with_the_names_it_could_be():
    with pytest.raises(FieldError, match="must be one of auto, matmul, onednn, native, got 'avx3'"):
        EngineConfig(linear_kernel="avx3")


def test_native_attention_set_explicitly_over_an_int8_cache_is_refused_but_auto_is_not():
    with pytest.raises(FieldError, match="native reads float32 K/V rows only"):
        EngineConfig(attention_kernel="avx2", cache=CacheConfig(kv_dtype="int8"))
    assert EngineConfig(cache=CacheConfig(kv_dtype="int8")).attention_kernel == "auto"


@needs_kernel
def test_an_engine_on_auto_runs_the_native_kernels_and_says_why(tiny_loaded):
    from tests.conftest import make_engine

    engine = make_engine(tiny_loaded)
    assert kinds(engine.kernels) == ("native", "native", "native")
    assert engine.model.linear.name == "native" and engine.model.pointwise.name == "native"
    assert engine.model.paged_attention is not None
    assert "extension built" in engine.kernels.linear.reason
    int8 = make_engine(tiny_loaded, kv_dtype="int8")
    assert kinds(int8.kernels) == ("native", "sdpa", "native") and int8.model.paged_attention is None
