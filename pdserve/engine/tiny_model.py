"""A tiny random-weight Llama in Hugging Face format, for tests that need a model but not a good one.

The directory holds config.json (LlamaForCausalLM), model.safetensors, tokenizer.json and
tokenizer_config.json (ChatML template), so it loads both with transformers'
LlamaForCausalLM.from_pretrained / AutoTokenizer and with pdserve's load_model.

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
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.weights import default_model_path, expected_shapes

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tiny_model(directory: str | Path, *, seed: int = 0, num_layers: int = 2, hidden_size: int = 64,
                     num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                     max_position_embeddings: int = 512, tie_word_embeddings: bool = False,
                     rope_theta: float = 10000.0, tokenizer: Tokenizer | None = None) -> Path:
    """Write the model to directory (created if needed) and return its path.

    Deterministic for a seed. `tokenizer` defaults to SmolLM2's, read from the embedded GGUF;
    pass one already loaded to skip that read (a few seconds).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or _smollm2_tokenizer()
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})")
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=hidden_size // num_heads, max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta, rms_norm_eps=1e-5, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids,
    )
    weights = random_state_dict(config, seed)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf_config_json(config), indent=2) + "\n")
    tokenizer.save(directory, chat_template=CHATML_TEMPLATE)
    return directory


def random_state_dict(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the config, drawn in a fixed (sorted) order from one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    state_dict = {}
    for name, shape in sorted(expected_shapes(config).items()):
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        elif name == "model.embed_tokens.weight":
            tensor = torch.randn(shape, generator=generator)
        else:  # (out, in): std 1/sqrt(in) keeps each layer's output on the embedding's scale
            tensor = torch.randn(shape, generator=generator) / math.sqrt(shape[1])
        state_dict[name] = tensor.contiguous()
    return state_dict


def hf_config_json(config: ModelConfig) -> dict[str, object]:
    """config.json as transformers' LlamaConfig reads it."""
    eos = list(config.eos_token_ids)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "torch_dtype": "float32",
    }


def _smollm2_tokenizer() -> Tokenizer:
    import gguf  # only needed to read the embedded model's tokenizer

    return Tokenizer.from_gguf_metadata(gguf.GGUFReader(default_model_path()))
