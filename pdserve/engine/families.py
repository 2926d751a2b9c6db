"""The model families pdserve serves, each as its differences from Llama, in one table.

    FAMILIES[name] -> Family       what the forward pass does differently (model.py reads it)
    family_of_hf(model_type)       a config.json's model_type -> its Family, or a clear refusal
    family_of_gguf(architecture)   a GGUF's general.architecture -> its Family, or a clear refusal

One decoder (pdserve/engine/model.py) runs every family; a Family only switches its parts on:

    family   qkv bias  q/k norm  norm   post norms  embed x sqrt(d)  MLP act   GGUF Q/K
    llama    -         -         w      -           -                SiLU      permuted
    mistral  -         -         w      -           -                SiLU      permuted
    qwen2    q, k, v   -         w      -           -                SiLU      as HF
    qwen3    -         per head  w      -           -                SiLU      as HF
    gemma3   -         per head  1 + w  yes         yes              GELU-tanh as HF

What varies by checkpoint rather than by family (rope scaling, head_dim, a sliding window and which
layers use it, query_pre_attn_scalar, a second rope theta) is read into ModelConfig by the loaders
(pdserve/engine/weights.py). docs/models.md says how to add a family.
"""

from __future__ import annotations

from dataclasses import dataclass

MODELS_DOC = "docs/models.md"


@dataclass(frozen=True)
class Family:
    name: str
    hf_model_types: tuple[str, ...]  # config.json model_type values
    gguf_architecture: str | None  # GGUF general.architecture
    qkv_bias: bool = False  # biases on the q, k and v projections (none on o)
    qk_norm: bool = False  # RMSNorm over each q and k head, before rope
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + w): Gemma stores w - 1
    post_norms: bool = False  # each sublayer's output is normed before it joins the residual
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size)
    activation: str = "silu"  # the MLP gate's: silu or gelu_tanh
    gguf_permuted_qk: bool = False  # llama.cpp's converter permuted the Q/K rows (Llama's rope layout)


FAMILIES = {family.name: family for family in (
    Family("llama", ("llama",), "llama", gguf_permuted_qk=True),
    Family("mistral", ("mistral",), None, gguf_permuted_qk=True),  # Mistral GGUFs say "llama"
    Family("qwen2", ("qwen2",), "qwen2", qkv_bias=True),
    Family("qwen3", ("qwen3",), "qwen3", qk_norm=True),
    Family("gemma3", ("gemma3_text", "gemma3"), "gemma3", qk_norm=True, norm_offset=1.0, post_norms=True,
           scale_embeddings=True, activation="gelu_tanh"),
)}

# Architectures people ask for that this decoder cannot run, with why (the refusal says it).
_MOE, _MLA = "a mixture of experts", "a mixture of experts with latent attention"
_NOT_SUPPORTED = {
    "mixtral": _MOE, "qwen2_moe": _MOE, "qwen3_moe": _MOE, "gpt_oss": _MOE, "llama4": _MOE, "olmoe": _MOE,
    "deepseek_v2": _MLA, "deepseek_v3": _MLA,
    "qwen3_next": "a hybrid with linear-attention layers", "jamba": "a hybrid with Mamba layers",
    "falcon_h1": "a hybrid with Mamba layers", "granitemoehybrid": "a hybrid with Mamba layers",
    "gemma2": "a model with attention logit soft-capping", "gemma3n": "a model with per-layer embeddings",
}


def supported() -> str:
    return ", ".join(FAMILIES)


def _refusal(kind: str, name: object, source: object) -> ValueError:
    why = _NOT_SUPPORTED.get(str(name))
    what = (f"{name!r} is {why}, which pdserve does not run" if why
            else f"{name!r} is not a family pdserve knows")
    return ValueError(f"{source}: {kind} {what}; pdserve serves {supported()} (see {MODELS_DOC})")


def family_of_hf(model_type: object, source: object = "config.json") -> Family:
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    raise _refusal("model_type", model_type, source)


def family_of_gguf(architecture: object, source: object = "GGUF") -> Family:
    for family in FAMILIES.values():
        if family.gguf_architecture == architecture:
            return family
    raise _refusal("general.architecture", architecture, source)
