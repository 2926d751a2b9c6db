"""Loading a GGUF file to a LoadedModel, through a converted-weights cache (pdserve/engine/weights.py
calls it for a .gguf path).

    GGUFReader ─ metadata → ModelConfig (the family's keys) ─ dequantise (gguf.quants)
               ─ tensor names → Hugging Face names ─ un-permute Q/K where the family's converter permuted them
               ─▶ LoadedModel, kept as safetensors under the cache so the next worker's load takes a second

NOTE: convert_hf_to_gguf.py permutes the rows of q_proj/k_proj of Llama-layout models so that
llama.cpp's RoPE can pair neighbouring elements (HF pairs element i with i + head_dim/2). We undo it
with the same reshape transformers uses (modeling_gguf_pytorch_utils.LlamaTensorProcessor), so our
dequantised weights equal transformers' to the bit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.named_models import sampling_defaults_at
from pdserve.engine.sampling_defaults import SamplingDefaults
from pdserve.engine.tokenizer import Tokenizer, read_gguf_metadata
from pdserve.engine.weights import (
    LoadedModel,
    _check_state_dict,
    _loaded,
    _progress,
    expected_shapes,
)

log = logging.getLogger(__name__)

# GGUF tensor name (within blk.N.) -> Hugging Face name (within model.layers.N.)
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
# --- GGUF, through the converted-weights cache --------------------------------------------
def load_gguf_cached(path: Path, progress: bool, cache_root: Path) -> LoadedModel:
    """load_gguf, reusing (or writing) a safetensors copy keyed by the file's path, size and mtime.

    NOTE: the cached copy is trusted only if it reproduces the fingerprint recorded when it
    was written; anything else (a partial write, another pdserve version) reloads the GGUF.
    """
    entry = _cache_entry(path, cache_root)
    if (entry / "meta.json").is_file():
        try:
            return _load_cache_entry(entry, path)
        except (OSError, ValueError, KeyError) as e:
            log.warning("ignoring the converted-weights cache at %s: %s", entry, e)
    loaded = load_gguf(path, progress)
    try:
        _write_cache_entry(entry, loaded)
    except OSError as e:  # a read-only home must not stop a load
        log.warning("could not cache converted weights at %s: %s", entry, e)
    return loaded


def _cache_entry(path: Path, cache_root: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|v1".encode()).hexdigest()[:24]
    return cache_root / "gguf" / key


def _write_cache_entry(entry: Path, loaded: LoadedModel) -> None:
    from safetensors.torch import save_file

    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(loaded.state_dict, str(tmp / "model.safetensors"))
    loaded.tokenizer.save(tmp)
    meta = {"config": dataclasses.asdict(loaded.config), "fingerprint": loaded.fingerprint}
    (tmp / "meta.json").write_text(json.dumps(meta))
    shutil.rmtree(entry, ignore_errors=True)
    os.replace(tmp, entry)


def _load_cache_entry(entry: Path, source: Path) -> LoadedModel:
    from safetensors.torch import load_file

    meta = json.loads((entry / "meta.json").read_text())
    raw = meta["config"]
    config = ModelConfig(**raw)
    tokenizer = Tokenizer.from_files(entry)
    loaded = _loaded(config, load_file(str(entry / "model.safetensors")), tokenizer, source,
                     gguf_sampling_defaults(source))
    if loaded.fingerprint != meta["fingerprint"]:
        raise ValueError("fingerprint differs from the one recorded at conversion")
    return loaded


# --- GGUF --------------------------------------------------------------------------------
def load_gguf(path: Path, progress: bool = True) -> LoadedModel:
    import gguf  # imported here: only GGUF loading needs it

    reader = gguf.GGUFReader(str(path))
    metadata = read_gguf_metadata(reader)
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    names = {tensor.name for tensor in reader.tensors}
    config = gguf_model_config(metadata, tokenizer, tied="output.weight" not in names, source=path)
    expected = expected_shapes(config)
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in _progress(reader.tensors, f"loading {path.name}", progress):
        name = _hf_name(tensor.name, path)
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if name.endswith("q_proj.weight"):
            weights = unpermute_rope_rows(weights, config.num_heads)
        elif name.endswith("k_proj.weight"):
            weights = unpermute_rope_rows(weights, config.num_kv_heads)
        state_dict[name] = torch.from_numpy(np.array(weights, dtype=np.float32, order="C", copy=True))
    _check_state_dict(state_dict, expected, path)
    return _loaded(config, state_dict, tokenizer, path, gguf_sampling_defaults(path))


def gguf_sampling_defaults(path: Path) -> SamplingDefaults:
    """A GGUF carries no generation config: a named model's file (engine/named_models.py: SmolLM2's
    model card, Gemma 3 270M's generation_config.json) gets its published values, any other GGUF the
    neutral ones (`pdserve up --default-*` sets them)."""
    return sampling_defaults_at(path)


def gguf_model_config(metadata: Mapping[str, Any], tokenizer: Tokenizer, *, tied: bool,
                      source: Path | str = "GGUF") -> ModelConfig:
    """ModelConfig from the `{arch}.*` keys; vocab size from the token list."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{source}: general.architecture is {arch!r}; pdserve runs 'llama' GGUF files")

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{source}: GGUF metadata lacks {arch}.{name}; "
                             "the file is incomplete -- re-convert it")
        return value

    if metadata.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{source}: {arch}.rope.scaling.type is {metadata[f'{arch}.rope.scaling.type']!r}; "
                         "pdserve implements plain RoPE only")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    return ModelConfig(
        vocab_size=len(metadata["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        max_position_embeddings=int(key("context_length")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
    )


def unpermute_rope_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's permute(w, n_head): rows (head, dim/2, 2) back to (head, 2, dim/2)."""
    half = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, half, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def _hf_name(gguf_name: str, source: Path) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    match = _GGUF_LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}"
    raise ValueError(f"{source}: tensor {gguf_name!r} is not part of a plain Llama model "
                     "(biases, rope_freqs and MoE tensors are not supported)")
