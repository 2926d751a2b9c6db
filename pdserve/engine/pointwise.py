"""The element-by-element work between a layer's products: RMSNorm, the residual add, RoPE, SiLU·up.

    select_pointwise(device, kernel) -> TorchPointwise or FusedPointwise   (EngineConfig.pointwise_kernel,
                                                                            auto resolved first)
    POINTWISE_KERNELS (pdserve/engine/config.py) = ("auto", "torch", "native")

torch is torch's own ops in the order Hugging Face's Llama runs them, so the model's logits stay
bit-equal to transformers' (tests/engine/test_oracle.py). native (what auto picks where the
extension is built) runs pdserve's fused kernels (pdserve/engine/pointwise.cpp): one pass over each
row where torch makes five to eight, as vLLM's CPU build does with its fused_add_rms_norm,
silu_and_mul and rotary_embedding. Its RoPE and residual sums are bit-equal to torch's; its norm and
SiLU differ by a few ulp (tests/engine/test_pointwise.py), and the exactness suite runs the engine
on it (the same test file, and every test on the default kernels).

A layer runs them as:

    x, residual = add_rms_norm(h, residual, ln1)   # residual None at layer 0: residual = h
    h = attention(rotary(qkv(x)))
    x, residual = add_rms_norm(h, residual, ln2)
    h = down(silu_and_mul(gate_up(x)))
    ... and after the last layer: rms_norm(residual + h, final_norm), for the sampled rows only.

The fused kernel works in place: add_rms_norm overwrites h with the norm and residual with the
sum, and rotary rotates the q/k columns of the qkv product where they lie. Every tensor it
overwrites is a fresh product or gather of the same step, read by nothing else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine import cpu_kernels

Rotation = tuple[torch.Tensor, torch.Tensor]  # cos and sin rows [T, 1, head_dim] (RotaryEmbedding.at)


class TorchPointwise:
    """torch's ops, as transformers runs them."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.float32:  # NOTE: as transformers: normed in float32, then rounded back
            wide = x.float()
            normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
            if weight.dtype == torch.float32:  # Gemma's order: scaled in float32, then rounded
                return (normed * weight).to(x.dtype)
            return weight * normed.to(x.dtype)  # Llama's: rounded, then scaled
        variance = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(variance + eps))

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x); x itself is the sum where residual is None."""
        total = x if residual is None else residual + x
        return self.rms_norm(total, weight, eps), total

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Gemma's MLP activation: GELU (tanh approximation) of the gate, times up; torch's on every
        kernel setting."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rotary(self, qkv: torch.Tensor, rot: Rotation, heads: int, head_dim: int) -> torch.Tensor:
        """The first `heads` heads of each qkv row, rotated (rotate-half, as Hugging Face Llama):
        [T, heads, D]."""
        x = qkv[:, :heads * head_dim].view(-1, heads, head_dim)
        cos, sin = rot
        half = head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class FusedPointwise(TorchPointwise):
    """pdserve's fused kernels (pointwise.cpp), in place where the module docstring says."""

    name = "native"

    def __init__(self) -> None:
        self._ops = torch.ops.pdserve

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._ops.rms_norm(x, weight, eps), x
        self._ops.add_rms_norm_(x, residual, weight, eps)
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._ops.silu_and_mul(gate_up)

    def rotary(self, qkv: torch.Tensor, rot: Rotation, heads: int, head_dim: int) -> torch.Tensor:
        self._ops.rotary_(qkv, rot[0], rot[1], heads, head_dim)
        return qkv[:, :heads * head_dim].view(-1, heads, head_dim)


def select_pointwise(device: torch.device, kernel: str = "torch") -> TorchPointwise:
    """The kernel named by EngineConfig.pointwise_kernel, once auto is resolved."""
    if kernel == "torch":
        return TorchPointwise()
    if kernel != "native":
        raise ValueError(f"pointwise kernel {kernel!r}: use torch or native (or auto, resolved by "
                         "pdserve/engine/kernel_choice.py)")
    if device.type != "cpu":
        raise ValueError(f"pointwise_kernel 'native' runs on the CPU only, not on {device}; "
                         "use torch or auto")
    if cpu_kernels.unavailable():
        raise ValueError(f"pointwise_kernel 'native' is not available: {cpu_kernels.unavailable()}; "
                         "use torch or auto")
    return FusedPointwise()
