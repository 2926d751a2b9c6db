"""KV cache memory planning: how many bytes a context costs, and how many fit.

    bytes per token    = 2 (K and V) x layers x kv_heads x (head_dim x bytes per element + scale bytes)
                         (the scale: 0 bytes for float32/float16/bfloat16, a float32 for int8 and fp8)
    bytes per sequence = bytes per token x tokens
    bytes total        = bytes per sequence x sequences

Given a memory budget, sequences_that_fit counts whole sequences of `tokens`
tokens; tokens_that_fit counts tokens however they are split among sequences.
Pure arithmetic: no torch. A model's shape can be read from a Hugging Face
folder (config.json) or a GGUF file's metadata.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.config import KV_DTYPE_TABLE, KV_DTYPES, kv_bytes_per_token
from pdserve.units import GIB


@dataclass(frozen=True)
class KVShape:
    """The part of a model's shape that sets its KV cache size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class KVPlan:
    shape: KVShape
    dtype: str
    tokens: int
    sequences: int
    bytes_per_token: int
    scale_bytes_per_token: int  # of bytes_per_token: the int8/fp8 scales (0 for the float dtypes)
    bytes_per_sequence: int
    bytes_total: int
    memory_gib: float | None = None
    sequences_that_fit: int | None = None  # set only when memory_gib is given
    tokens_that_fit: int | None = None
    host_gib: float | None = None  # the host-memory tier (--host-cache-gib); None: not asked
    host_tokens_that_fit: int | None = None
    disk_gib: float | None = None  # the disk tier (--disk-cache-gib)
    disk_tokens_that_fit: int | None = None

    def as_dict(self) -> dict[str, object]:
        """Flat, JSON-ready; the *_that_fit keys appear only when a memory budget was given."""
        out: dict[str, object] = {
            "num_layers": self.shape.num_layers,
            "num_kv_heads": self.shape.num_kv_heads,
            "head_dim": self.shape.head_dim,
            "dtype": self.dtype,
            "tokens": self.tokens,
            "sequences": self.sequences,
            "bytes_per_token": self.bytes_per_token,
            "scale_bytes_per_token": self.scale_bytes_per_token,
            "bytes_per_sequence": self.bytes_per_sequence,
            "bytes_total": self.bytes_total,
        }
        if self.memory_gib is not None:
            out["memory_gib"] = self.memory_gib
            out["sequences_that_fit"] = self.sequences_that_fit
            out["tokens_that_fit"] = self.tokens_that_fit
        for tier in ("host", "disk"):
            if getattr(self, f"{tier}_gib") is not None:
                out[f"{tier}_gib"] = getattr(self, f"{tier}_gib")
                out[f"{tier}_tokens_that_fit"] = getattr(self, f"{tier}_tokens_that_fit")
        return out


def _require_positive_int(name: str, flag: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} ({flag}) must be a whole number, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} ({flag}) must be >= 1, got {value}")


def plan_kv(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    tokens: int,
    sequences: int = 1,
    memory_gib: float | None = None,
    host_gib: float | None = None,
    disk_gib: float | None = None,
) -> KVPlan:
    """KV bytes for `sequences` sequences of `tokens` tokens, and what fits in `memory_gib` GiB (and
    in a host tier of host_gib, a disk tier of disk_gib: a block there holds the same bytes)."""
    for name, flag, value in (
        ("num_layers", "--layers", num_layers),
        ("num_kv_heads", "--kv-heads", num_kv_heads),
        ("head_dim", "--head-dim", head_dim),
        ("tokens", "--tokens", tokens),
        ("sequences", "--sequences", sequences),
    ):
        _require_positive_int(name, flag, value)
    if dtype not in KV_DTYPES:
        raise ValueError(f"dtype (--dtype) must be one of {', '.join(KV_DTYPES)}, got {dtype!r}")
    for name, flag, gib in (("memory_gib", "--memory-gib", memory_gib), ("host_gib", "--host-gib", host_gib),
                            ("disk_gib", "--disk-gib", disk_gib)):
        if gib is not None and not (gib > 0 and math.isfinite(gib)):
            raise ValueError(f"{name} ({flag}) must be a finite number > 0, got {gib}")

    per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
    per_sequence = per_token * tokens
    fit_sequences = fit_tokens = None
    if memory_gib is not None:
        memory_bytes = math.floor(memory_gib * GIB)
        fit_sequences = memory_bytes // per_sequence
        fit_tokens = memory_bytes // per_token
    return KVPlan(
        shape=KVShape(num_layers, num_kv_heads, head_dim),
        dtype=dtype,
        tokens=tokens,
        sequences=sequences,
        bytes_per_token=per_token,
        scale_bytes_per_token=2 * num_layers * num_kv_heads * KV_DTYPE_TABLE[dtype].scale_bytes,
        bytes_per_sequence=per_sequence,
        bytes_total=per_sequence * sequences,
        memory_gib=memory_gib,
        sequences_that_fit=fit_sequences,
        tokens_that_fit=fit_tokens,
        host_gib=host_gib,
        host_tokens_that_fit=None if host_gib is None else math.floor(host_gib * GIB) // per_token,
        disk_gib=disk_gib,
        disk_tokens_that_fit=None if disk_gib is None else math.floor(disk_gib * GIB) // per_token,
    )


def plan_for_model(
    path: str | Path,
    dtype: str,
    tokens: int,
    sequences: int = 1,
    memory_gib: float | None = None,
    host_gib: float | None = None,
    disk_gib: float | None = None,
) -> KVPlan:
    """plan_kv with the shape read from a Hugging Face model folder or a .gguf file."""
    shape = read_kv_shape(path)
    return plan_kv(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype, tokens, sequences, memory_gib,
                   host_gib, disk_gib)


def read_kv_shape(path: str | Path) -> KVShape:
    """Layers, KV heads and head dim of the model at `path` (a folder with config.json, or a .gguf)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
    if p.is_dir():
        return _shape_from_config_json(p / "config.json")
    if p.suffix == ".gguf":
        return _shape_from_gguf(p)
    raise ValueError(
        f"cannot read a model shape from {str(p)!r}: give a Hugging Face model folder "
        "(with config.json) or a .gguf file")


def _shape_from_config_json(config_path: Path) -> KVShape:
    if not config_path.is_file():
        raise FileNotFoundError(
            f"no config.json in {str(config_path.parent)!r}; a Hugging Face model folder needs "
            "config.json next to its *.safetensors")
    config = json.loads(config_path.read_text())

    def field(key: str) -> int:
        if config.get(key) is None:
            raise ValueError(f"{config_path}: missing {key!r}, needed to size the KV cache")
        return int(config[key])

    num_heads = field("num_attention_heads")
    num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
    head_dim = int(config.get("head_dim") or field("hidden_size") // num_heads)
    return KVShape(field("num_hidden_layers"), num_kv_heads, head_dim)


def _shape_from_gguf(gguf_path: Path) -> KVShape:
    from gguf import GGUFReader  # lazy: keeps this module free of numpy for pure callers

    fields = GGUFReader(str(gguf_path)).fields

    def value(key: str) -> object | None:
        return fields[key].contents() if key in fields else None

    def number(key: str, default: int | None = None) -> int:
        found = value(key)
        if found is None:
            if default is None:
                raise ValueError(f"{gguf_path}: metadata key {key!r} is missing, needed to size the KV cache")
            return default
        if isinstance(found, list):  # per-layer values: the formula needs them all equal
            if len(set(found)) != 1:
                raise ValueError(f"{gguf_path}: {key!r} differs between layers ({found}); not supported")
            found = found[0]
        return int(found)

    arch = value("general.architecture")
    if arch is None:
        raise ValueError(f"{gguf_path}: no 'general.architecture' in its metadata; is it a model GGUF?")
    num_heads = number(f"{arch}.attention.head_count")
    num_kv_heads = number(f"{arch}.attention.head_count_kv", num_heads)
    head_dim = number(f"{arch}.attention.key_length", 0) or number(f"{arch}.embedding_length") // num_heads
    return KVShape(number(f"{arch}.block_count"), num_kv_heads, head_dim)
