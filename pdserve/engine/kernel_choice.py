"""Which kernels an engine runs: EngineConfig's `auto` (or an explicit setting) resolved once, at build.

    find_support(device, kv_dtype, dtype) -> KernelSupport  what this machine offers (probes torch and
                                                            the extension: the one impure part)
    choose_kernels(linear, attention, pointwise, support) -> KernelChoices   pure: each choice and why

auto picks pdserve's native kernels (pdserve/engine/cpu_kernels.py) where the device is a CPU with
AVX2, the extension is built and the model's dtype is float32 (what they read), and for attention
where the KV dtype is one the native kernel reads (float32); else torch's: matmul, sdpa, torch. On a
CUDA device attention is pdserve's Triton paged kernels (pdserve/engine/triton_attention.py, every KV
dtype) where Triton is installed, else sdpa; the products and pointwise work are torch's there. The
CPU never picks triton by itself: it runs there only under Triton's interpreter, which is for tests.
An explicit setting is kept as set: the engine fails at build where it cannot run
(pdserve/engine/linear.py and the other select_ functions say why), so a user who asked for a kernel
never silently gets another.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.config import DtypeChoice

NATIVE_ATTENTION_KV_DTYPES = ("float32",)  # the K/V rows decode_attention.cpp and prefill_attention.cpp read
TORCH_KERNELS = {"linear": "matmul", "attention": "sdpa", "pointwise": "torch"}
ISA_NAMES = {"AVX512": "AVX-512", "AVX2": "AVX2"}


@dataclass(frozen=True)
class KernelSupport:
    """What the native kernels need, as found where the engine runs."""

    device_type: str  # torch.device.type: cpu, cuda, ...
    cpu_capability: str  # torch.backends.cpu.get_cpu_capability(): AVX512, AVX2, DEFAULT, ...
    extension_unavailable: str | None  # why pdserve's CPU kernels cannot be built or run; None: built
    kv_dtype: str  # CacheConfig.kv_dtype
    triton_unavailable: str | None = "not probed"  # why Triton's kernels cannot run here; None: they can
    dtype: str = "float32"  # EngineConfig.dtype, resolved: the native kernels read float32 only


@dataclass(frozen=True)
class KernelChoice:
    setting: str  # linear, attention or pointwise (EngineConfig's <setting>_kernel)
    kernel: str  # what runs: never auto
    reason: str  # why, in words

    def describe(self) -> str:
        return f"{self.setting} {self.kernel} ({self.reason})"


@dataclass(frozen=True)
class KernelChoices:
    linear: KernelChoice
    attention: KernelChoice
    pointwise: KernelChoice
    # the resolved dtype and kv_dtype with their reasons (EngineConfig.resolved), for describe()
    dtypes: tuple[DtypeChoice, ...] = ()

    def all(self) -> tuple[KernelChoice, KernelChoice, KernelChoice]:
        return self.linear, self.attention, self.pointwise

    def describe(self) -> str:
        """One line for a log: the dtypes, then each setting's kernel, and why."""
        return "; ".join(choice.describe() for choice in (*self.dtypes, *self.all()))


def choose_kernels(linear: str, attention: str, pointwise: str, support: KernelSupport) -> KernelChoices:
    """Each setting's kernel: an explicit one as set, auto resolved against `support`."""
    native_reason, torch_reason = _native_or_why_not(support)
    attention_torch_reason = torch_reason
    if torch_reason is None and support.kv_dtype not in NATIVE_ATTENTION_KV_DTYPES:
        attention_torch_reason = (f"auto: kv_dtype {support.kv_dtype}: the native attention reads "
                                  f"{', '.join(NATIVE_ATTENTION_KV_DTYPES)} K/V rows only")
    attention_choice = _choose("attention", attention, native_reason, attention_torch_reason)
    if attention == "auto" and support.device_type == "cuda":
        attention_choice = _cuda_attention(support)
    return KernelChoices(_choose("linear", linear, native_reason, torch_reason), attention_choice,
                         _choose("pointwise", pointwise, native_reason, torch_reason))


def _cuda_attention(support: KernelSupport) -> KernelChoice:
    if support.triton_unavailable is None:
        return KernelChoice("attention", "triton", "auto: cuda, Triton's paged kernels")
    return KernelChoice("attention", "sdpa",
                        f"auto: cuda, but Triton cannot run: {support.triton_unavailable}")


def _native_or_why_not(support: KernelSupport) -> tuple[str, str | None]:
    """(why native, None) where the native kernels run; else (_, why torch's)."""
    isa = ISA_NAMES.get(support.cpu_capability, support.cpu_capability)
    native = f"auto: {isa} CPU, extension built"
    if support.device_type != "cpu":
        return native, f"auto: the device is {support.device_type}, the native kernels run on CPUs only"
    if support.extension_unavailable is not None:
        return native, f"auto: extension not built: {support.extension_unavailable}"
    if support.dtype != "float32":
        return native, f"auto: dtype {support.dtype}: the native kernels read float32 only"
    return native, None


def _choose(setting: str, requested: str, native_reason: str, torch_reason: str | None) -> KernelChoice:
    if requested != "auto":
        return KernelChoice(setting, requested, f"set: {setting}_kernel {requested}")
    if torch_reason is None:
        return KernelChoice(setting, "native", native_reason)
    return KernelChoice(setting, TORCH_KERNELS[setting], torch_reason)


def find_support(device_type: str, kv_dtype: str, dtype: str = "float32") -> KernelSupport:
    """This machine's answers: torch's CPU capability, and whether the extension builds (it is built
    here on first use where `make setup` did not: a minute or two once, cached after)."""
    import torch

    from pdserve.engine import cpu_kernels, triton_attention

    unavailable = cpu_kernels.unavailable() if device_type == "cpu" else None
    triton_unavailable = triton_attention.unavailable() if device_type == "cuda" else "not a CUDA device"
    return KernelSupport(device_type, torch.backends.cpu.get_cpu_capability(), unavailable, kv_dtype,
                         triton_unavailable, dtype)
