"""Loading a GGUF file to a LoadedModel, through a converted-weights cache (pdserve/engine/weights.py
calls it for a .gguf path).

    GGUFReader ─ general.architecture → Family (families.py) ─ metadata → ModelConfig (the family's keys,
               and rope_freqs → rope_freq_factors) ─ dequantise (gguf.quants) ─ the family's tensor names
               → Hugging Face names ─ un-permute Q/K (Llama layout) ─ subtract the norm offset (Gemma)
               ─▶ LoadedModel, kept as safetensors under the cache so the next worker's load takes a second

NOTE: convert_hf_to_gguf.py permutes the rows of q_proj/k_proj of Llama-layout models so that
llama.cpp's RoPE can pair neighbouring elements (HF pairs element i with i + head_dim/2). We undo it
with the same reshape transformers uses (modeling_gguf_pytorch_utils.LlamaTensorProcessor), so our
dequantised weights equal transformers' to the bit. Gemma's converter stores each norm weight as
1 + w (llama.cpp's RMSNorm multiplies by the weight alone); we subtract the family's norm_offset as
transformers' Gemma2TensorProcessor does, in float32, so the state dict holds Hugging Face's values.

What llama.cpp hard-codes rather than reads (Gemma 3's layer pattern, its local rope base and its
attention scalar) is hard-coded here the same way, unless the file carries a key for it.
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
from pdserve.engine.families import MODELS_DOC, Family, family_of_gguf
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

# GGUF tensor name (within blk.N.) -> Hugging Face name (within model.layers.N.): Llama's, then what
# each part of a family (families.py) adds or names otherwise. NOTE: `ffn_norm` is the norm before
# the MLP in both; Llama calls it post_attention_layernorm, Gemma 3 pre_feedforward_layernorm (its
# post_attention_layernorm normalises the attention's output, GGUF's post_attention_norm).
_LLAMA_LAYER_NAMES = {
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
_QKV_BIAS_NAMES = {"attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
                   "attn_v.bias": "self_attn.v_proj.bias"}
_QK_NORM_NAMES = {"attn_q_norm.weight": "self_attn.q_norm.weight",
                  "attn_k_norm.weight": "self_attn.k_norm.weight"}
_POST_NORM_NAMES = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                    "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.x: a factor per rope frequency, read into ModelConfig


def gguf_layer_names(family: Family) -> dict[str, str]:
    """The family's GGUF layer tensor names -> Hugging Face names."""
    names = dict(_LLAMA_LAYER_NAMES)
    if family.qkv_bias:
        names |= _QKV_BIAS_NAMES
    if family.qk_norm:
        names |= _QK_NORM_NAMES
    if family.post_norms:
        names |= _POST_NORM_NAMES
    return names


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
    config, state_dict = read_gguf_model(reader, metadata, tokenizer, source=path, progress=progress)
    return _loaded(config, state_dict, tokenizer, path, gguf_sampling_defaults(path))


def read_gguf_model(reader: Any, metadata: Mapping[str, Any], tokenizer: Tokenizer | None = None, *,
                    source: Path | str = "GGUF", progress: bool = False,
                    ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The ModelConfig and the Hugging Face state dict of a gguf.GGUFReader's file (tokenizer: where
    the eos ids come from; None: the file's tokenizer.ggml ids, for a vocabulary pdserve cannot read)."""
    import gguf

    family = family_of_gguf(metadata.get("general.architecture"), source)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    factors = tensors.pop(ROPE_FREQS, None)
    freq_factors = () if factors is None else tuple(
        float(f) for f in np.asarray(gguf.quants.dequantize(factors.data, factors.tensor_type)).reshape(-1))
    config = gguf_model_config(metadata, tokenizer, tied="output.weight" not in tensors,
                               rope_freq_factors=freq_factors, source=source)
    names = gguf_layer_names(family)
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in _progress(list(tensors.values()), f"loading {Path(str(source)).name}", progress):
        name = _hf_name(tensor.name, names, family, source)
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if family.gguf_permuted_qk and name.endswith("q_proj.weight"):
            weights = unpermute_rope_rows(weights, config.num_heads)
        elif family.gguf_permuted_qk and name.endswith("k_proj.weight"):
            weights = unpermute_rope_rows(weights, config.num_kv_heads)
        elif family.norm_offset and tensor.name.endswith("norm.weight"):
            weights = weights - np.float32(family.norm_offset)  # the converter stored w + offset
        state_dict[name] = torch.from_numpy(np.array(weights, dtype=np.float32, order="C", copy=True))
    _check_state_dict(state_dict, expected_shapes(config), Path(str(source)))
    return config, state_dict


def gguf_sampling_defaults(path: Path) -> SamplingDefaults:
    """A GGUF carries no generation config: a named model's file (engine/named_models.py: SmolLM2's
    model card, Gemma 3 270M's generation_config.json) gets its published values, any other GGUF the
    neutral ones (`pdserve up --default-*` sets them)."""
    return sampling_defaults_at(path)


def gguf_model_config(metadata: Mapping[str, Any], tokenizer: Tokenizer | None = None, *, tied: bool,
                      rope_freq_factors: tuple[float, ...] = (), source: Path | str = "GGUF") -> ModelConfig:
    """ModelConfig from the `{arch}.*` keys (as llama.cpp's llama-model.cpp reads them); vocab size
    from the token list; rope_freq_factors: the file's rope_freqs tensor (Llama 3.x)."""
    arch = metadata.get("general.architecture")
    family = family_of_gguf(arch, source)

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{source}: GGUF metadata lacks {arch}.{name}; "
                             "the file is incomplete -- re-convert it")
        return value

    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{source}: GGUF metadata lacks tokenizer.ggml.tokens (the vocabulary, as long as "
                         "the embedding); re-convert the file")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    layers = int(key("block_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    if rope_freq_factors and len(rope_freq_factors) != head_dim // 2:
        raise ValueError(f"{source}: {ROPE_FREQS} has {len(rope_freq_factors)} factors; a head of {head_dim} "
                         f"has {head_dim // 2} rope frequencies -- re-convert the file")
    if tokenizer is not None:
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_ids
    else:
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        eos = tuple(int(i) for i in [metadata.get("tokenizer.ggml.eos_token_id")] if i is not None)
    return ModelConfig(
        vocab_size=len(tokens),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(key("context_length")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=tied,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos),
        architecture=family.name,
        rope_freq_factors=rope_freq_factors,
        **_rope_scaling(metadata, arch, source),
        **(_gemma3_attention(metadata, arch, layers, hidden // heads, head_dim)
           if family.name == "gemma3" else {}),
    )


def _rope_scaling(metadata: Mapping[str, Any], arch: str, source: Path | str) -> dict[str, Any]:
    """`{arch}.rope.scaling.*`: none, or linear (positions divided by the factor)."""
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return {}
    if kind == "linear":
        factor = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0))
        return {"rope_scaling": "linear", "rope_factor": factor}
    raise ValueError(f"{source}: {arch}.rope.scaling.type is {kind!r}; pdserve runs plain, linear and "
                     f"Llama 3 (rope_freqs) RoPE (see {MODELS_DOC})")


# llama.cpp's Gemma 3 (llama-model.cpp, LLM_ARCH_GEMMA3): every 6th layer attends the whole context,
# the others a window, with their own rope base; the 27B (62 layers) scales queries by
# (hidden / heads)^-1/2, the others by head_dim^-1/2. Neither is in the file unless given by the keys.
_GEMMA3_PATTERN, _GEMMA3_LOCAL_THETA, _GEMMA3_27B_LAYERS = 6, 10_000.0, 62


def _gemma3_attention(metadata: Mapping[str, Any], arch: str, layers: int, hidden_per_head: int,
                      head_dim: int) -> dict[str, Any]:
    scalar = hidden_per_head if layers == _GEMMA3_27B_LAYERS else head_dim
    fields: dict[str, Any] = {"query_pre_attn_scalar": float(scalar)}
    window = metadata.get(f"{arch}.attention.sliding_window")
    if not window:  # newer llama.cpp: no key (or 0) means every layer attends the whole context
        return fields
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", _GEMMA3_PATTERN)
    if isinstance(pattern, (list, tuple)):  # one flag per layer: true where the layer slides
        sliding = tuple(i for i, slides in enumerate(pattern) if slides)
    else:  # llama.cpp's set_swa_pattern(n): all but each n-th layer (every layer for n = 0)
        n = int(pattern)
        sliding = tuple(i for i in range(layers) if n == 0 or i % n < n - 1)
    local_theta = metadata.get(f"{arch}.rope.freq_base_swa", _GEMMA3_LOCAL_THETA)
    return fields | {"sliding_window": int(window), "sliding_layers": sliding,
                     "rope_local_theta": float(local_theta)}


def unpermute_rope_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's permute(w, n_head): rows (head, dim/2, 2) back to (head, 2, dim/2)."""
    half = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, half, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def _hf_name(gguf_name: str, layer_names: Mapping[str, str], family: Family, source: Path | str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    match = _GGUF_LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in layer_names:
        return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}"
    raise ValueError(f"{source}: tensor {gguf_name!r} is not part of a {family.name} model as pdserve "
                     f"runs it (see {MODELS_DOC})")
