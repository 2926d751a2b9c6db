"""A tiny random-weight model of any of pdserve's families in Hugging Face format, for tests that
need a model but not a good one.

The directory holds config.json (LlamaForCausalLM, or its family's class), model.safetensors,
tokenizer.json and tokenizer_config.json (ChatML template), so it loads both with transformers'
AutoModelForCausalLM.from_pretrained / AutoTokenizer and with pdserve's load_model.

The tokenizer is SmolLM2's own (exported from the embedded GGUF), so token ids, chat prompts and
vocab_size (49152) are those of the real model: tests can swap the tiny model for SmolLM2
without touching any prompt or expected id.

NOTE on the weights: with the usual normal(0, 0.02) everywhere, a random Llama is close to the
identity map -- the residual stream is the embedding and greedy decoding repeats one token. We
give the embeddings unit variance and every projection std 1/sqrt(fan_in), so each layer moves
the stream by about as much as the embedding itself and attention to earlier tokens changes the
argmax: continuations vary with the whole prompt, which is what cache tests need to catch bugs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.engine.config import ModelConfig
from pdserve.engine.families import FAMILIES
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.weights import default_model_path, expected_shapes

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Each family's tiny twin: ModelConfig fields on top of the defaults of write_tiny_model, chosen so
# that every part the family has is exercised at test lengths: a llama3 rope whose three frequency
# bands all occur below 512 positions, windows shorter than the tests' prompts, a head_dim that is
# not hidden / heads, and an attention scalar that is not head_dim.
TINY_ARCHS: dict[str, dict[str, object]] = {
    "llama": {},
    "llama3": {"rope_scaling": "llama3", "rope_factor": 8.0, "rope_low_freq_factor": 1.0,
               "rope_high_freq_factor": 4.0, "rope_original_max_positions": 64},
    "mistral": {"architecture": "mistral", "sliding_window": 40, "sliding_layers": (0, 1)},
    "qwen2": {"architecture": "qwen2", "tie_word_embeddings": True, "rope_theta": 1_000_000.0},
    "qwen3": {"architecture": "qwen3", "head_dim": 32},
    "gemma3": {"architecture": "gemma3", "head_dim": 32, "num_kv_heads": 1, "tie_word_embeddings": True,
               "rope_theta": 1_000_000.0, "rope_local_theta": 10_000.0, "sliding_window": 24,
               "sliding_layers": (0,), "query_pre_attn_scalar": 24.0, "rms_norm_eps": 1e-6},
}


def write_tiny_model(directory: str | Path, *, seed: int = 0, num_layers: int = 2, hidden_size: int = 64,
                     num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                     max_position_embeddings: int = 512, tie_word_embeddings: bool = False,
                     rope_theta: float = 10000.0, tokenizer: Tokenizer | None = None,
                     arch: str = "llama") -> Path:
    """Write the model to directory (created if needed) and return its path.

    arch: a key of TINY_ARCHS (a family, or llama3: Llama with Llama 3's rope scaling), whose fields
    override these arguments. Deterministic for a seed. `tokenizer` defaults to SmolLM2's, read from
    the embedded GGUF; pass one already loaded to skip that read (a few seconds).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or _smollm2_tokenizer()
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch {arch!r}: use one of {', '.join(TINY_ARCHS)}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})")
    fields = dict(
        vocab_size=tokenizer.vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=hidden_size // num_heads, max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta, rms_norm_eps=1e-5, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids,
    )
    config = ModelConfig(**(fields | TINY_ARCHS[arch]))  # type: ignore[arg-type]
    weights = random_state_dict(config, seed)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf_config_json(config), indent=2) + "\n")
    tokenizer.save(directory, chat_template=CHATML_TEMPLATE)
    return directory


def random_state_dict(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the config, drawn in a fixed (sorted) order from one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    offset = FAMILIES[config.architecture].norm_offset  # a norm scales by offset + w: about 1 either way
    state_dict = {}
    for name, shape in sorted(expected_shapes(config).items()):
        if name.endswith("norm.weight"):
            tensor = 1.0 - offset + 0.1 * torch.randn(shape, generator=generator)
        elif name == "model.embed_tokens.weight":
            tensor = torch.randn(shape, generator=generator)
        elif name.endswith(".bias"):
            tensor = 0.1 * torch.randn(shape, generator=generator)
        else:  # (out, in): std 1/sqrt(in) keeps each layer's output on the embedding's scale
            tensor = torch.randn(shape, generator=generator) / math.sqrt(shape[1])
        state_dict[name] = tensor.contiguous()
    return state_dict


_HF_CLASSES = {"llama": ("LlamaForCausalLM", "llama"), "mistral": ("MistralForCausalLM", "mistral"),
               "qwen2": ("Qwen2ForCausalLM", "qwen2"), "qwen3": ("Qwen3ForCausalLM", "qwen3"),
               "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}


def hf_config_json(config: ModelConfig) -> dict[str, object]:
    """config.json as transformers reads it for the config's family (what weights.hf_model_config
    reads back to the same ModelConfig)."""
    eos = list(config.eos_token_ids)
    family = FAMILIES[config.architecture]
    architecture, model_type = _HF_CLASSES[config.architecture]
    raw: dict[str, object] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": family.qkv_bias,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "torch_dtype": "float32",
    }
    raw["hidden_activation" if family.activation == "gelu_tanh" else "hidden_act"] = (
        "gelu_pytorch_tanh" if family.activation == "gelu_tanh" else "silu")
    if family.name in ("llama", "mistral"):
        raw["mlp_bias"] = False
    if config.rope_scaling != "default":
        raw["rope_scaling"] = {"rope_type": config.rope_scaling, "factor": config.rope_factor} | (
            {"low_freq_factor": config.rope_low_freq_factor, "high_freq_factor": config.rope_high_freq_factor,
             "original_max_position_embeddings": config.rope_original_max_positions}
            if config.rope_scaling == "llama3" else {})
    if family.name in ("qwen2", "qwen3"):
        raw["use_sliding_window"] = False
    if config.sliding_window is not None or family.name == "mistral":
        raw["sliding_window"] = config.sliding_window
    if family.name == "gemma3":
        raw |= {"query_pre_attn_scalar": int(config.query_pre_attn_scalar or config.head_dim),
                "rope_local_base_freq": config.rope_local_theta,
                "layer_types": ["sliding_attention" if i in config.sliding_layers else "full_attention"
                                for i in range(config.num_layers)],
                "final_logit_softcapping": None, "attn_logit_softcapping": None}
    return raw


def _smollm2_tokenizer() -> Tokenizer:
    import gguf  # only needed to read the embedded model's tokenizer

    return Tokenizer.from_gguf_metadata(gguf.GGUFReader(default_model_path()))
