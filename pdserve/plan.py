"""KV cache memory planning: how many bytes a context costs, and how many fit.

    bytes per token    = 2 (K and V) x layers x kv_heads x (head_dim x bytes per element + scale bytes)
                         (the scale: 0 bytes for float32/float16/bfloat16, a float32 for int8 and fp8)
    bytes per sequence = bytes per token x tokens
    bytes total        = bytes per sequence x sequences

Given a memory budget, sequences_that_fit counts whole sequences of `tokens`
tokens; tokens_that_fit counts tokens however they are split among sequences.
Pure arithmetic: no torch. A model's shape can be read from a Hugging Face
folder (config.json) or a GGUF file's metadata.

With a model, the plan also counts the weights a worker keeps beside its KV cache:

    weight bytes = parameters x 4    (float32, one copy of each: pdserve/engine/linear.py; a tied
                                      embedding is kept once, in the lm_head's native panels)
                   + vocab x hidden x 4 where a tied model runs linear_kernel matmul or onednn
                                     (they keep the embedding table beside their copy of the head)

and, given a GPU's memory (--gpu-memory-gib), the pool a worker on it sizes for itself when neither
cache.num_blocks nor cache.kv_cache_gib is set (pdserve/engine/config.py gpu_pool_blocks, vLLM's rule):

    pool bytes = GPU bytes x gpu_memory_utilization - weight bytes - activation reserve
    weight bytes = (parameters + a tied model's embedding table) x the dtype's bytes (torch's matmul)
    blocks = pool bytes // (KV bytes per token x block size)

A worker reads its GPU's free memory once its weights are loaded, so its CUDA context (and any other
process on the GPU) comes off its pool too; the plan cannot see those.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from pdserve.engine.config import (
    KV_DTYPE_TABLE,
    KV_DTYPES,
    ModelConfig,
    activation_reserve_bytes,
    gpu_pool_blocks,
    kv_bytes_per_token,
)
from pdserve.units import GIB, human_bytes


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
    weights: WeightPlan | None = None  # set when the plan is for a model (plan_for_model)

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
        if self.weights is not None:
            out["weight_bytes"] = self.weights.bytes_resident
            out["weight_bytes_tied_table"] = self.weights.tied_table_bytes
        return out


@dataclass(frozen=True)
class WeightPlan:
    """The float32 weights a worker keeps resident (the module docstring's formula)."""

    parameters: int  # the model's parameters, a tied embedding counted once
    tied_table_bytes: int  # a tied model on matmul/onednn keeps this much more (0: untied)

    @property
    def bytes_resident(self) -> int:
        """On the default kernels (auto: native where the CPU and the extension run it)."""
        return 4 * self.parameters

    def bytes_in(self, dtype: str) -> int:
        """In dtype on torch's kernels (a GPU's): each parameter, and a tied model's table beside its head."""
        element = KV_DTYPE_TABLE[dtype].element_bytes
        return (4 * self.parameters + self.tied_table_bytes) // 4 * element

    def describe(self) -> str:
        table = human_bytes(self.tied_table_bytes, 2)
        tied = f"; tied, so linear_kernel matmul or onednn keep {table} more" if self.tied_table_bytes else ""
        return (f"{self.bytes_resident:,} B ({human_bytes(self.bytes_resident, 2)}) per worker, float32, "
                f"each once{tied}")


@dataclass(frozen=True)
class GpuPoolPlan:
    """The pool of a worker on a GPU of gpu_memory_gib, by the module docstring's rule."""

    gpu_memory_gib: float
    utilization: float
    model_dtype: str
    weight_bytes: int  # in model_dtype, on torch's kernels
    reserve_bytes: int  # activation_reserve_bytes at the scheduler's defaults
    block_size: int
    block_bytes: int
    num_blocks: int

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def as_dict(self) -> dict[str, object]:
        return {"model_dtype": self.model_dtype, "gpu_memory_gib": self.gpu_memory_gib,
                "gpu_memory_utilization": self.utilization, "gpu_weight_bytes": self.weight_bytes,
                "gpu_activation_reserve_bytes": self.reserve_bytes, "block_size": self.block_size,
                "gpu_num_blocks": self.num_blocks, "gpu_tokens": self.num_blocks * self.block_size}

    def describe(self) -> str:
        gib = lambda n: human_bytes(n, 2)  # noqa: E731
        usable = gib(int(self.gpu_memory_gib * GIB * self.utilization))
        return (f"on a GPU of {self.gpu_memory_gib:g} GiB at gpu_memory_utilization {self.utilization:g}: "
                f"{usable} - {gib(self.weight_bytes)} weights ({self.model_dtype}) - "
                f"{gib(self.reserve_bytes)} activation reserve -> {self.num_blocks:,} "
                f"blocks of {self.block_size} tokens ({self.num_blocks * self.block_size:,} tokens, "
                f"{gib(self.pool_bytes)}), less what the CUDA context takes")


def plan_gpu_pool(config: ModelConfig, weights: WeightPlan, kv_dtype: str, model_dtype: str,
                  gpu_memory_gib: float, utilization: float, block_size: int, max_batched_tokens: int,
                  max_num_seqs: int) -> GpuPoolPlan:
    """The GPU rule for a model: its weights loaded on an otherwise empty GPU of gpu_memory_gib."""
    if not (gpu_memory_gib > 0 and math.isfinite(gpu_memory_gib)):
        raise ValueError(f"gpu_memory_gib (--gpu-memory-gib) must be a finite number > 0, "
                         f"got {gpu_memory_gib}")
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization (--gpu-memory-utilization) must be in (0, 1], "
                         f"got {utilization}")
    _require_positive_int("block_size", "--block-size", block_size)
    total = math.floor(gpu_memory_gib * GIB)
    weight_bytes = weights.bytes_in(model_dtype)
    reserve = activation_reserve_bytes(config, max_batched_tokens, max_num_seqs, model_dtype)
    block_bytes = config.kv_bytes_per_token(kv_dtype) * block_size
    blocks = gpu_pool_blocks(total - weight_bytes, total, utilization, block_bytes, reserve)
    return GpuPoolPlan(gpu_memory_gib, utilization, model_dtype, weight_bytes, reserve, block_size,
                       block_bytes, blocks)


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
    """plan_kv with the shape read from a Hugging Face model folder or a .gguf file, and the weights
    counted beside it."""
    shape = read_kv_shape(path)
    plan = plan_kv(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype, tokens, sequences, memory_gib,
                   host_gib, disk_gib)
    return replace(plan, weights=read_weight_plan(path))


def read_weight_plan(path: str | Path) -> WeightPlan:
    """The weights of the model at `path` (a folder with config.json, or a .gguf): read_kv_shape's
    checks apply first."""
    p = Path(path)
    read_kv_shape(p)
    if p.is_dir():
        return _weights_from_config_json(p / "config.json")
    return _weights_from_gguf(p)


def _weights_from_config_json(config_path: Path) -> WeightPlan:
    """Llama's parameters from its config.json: embedding, per layer q/k/v/o, gate/up/down and two
    norms, the final norm, and an untied lm_head."""
    config = json.loads(config_path.read_text())

    def field(key: str) -> int:
        if config.get(key) is None:
            raise ValueError(f"{config_path}: missing {key!r}, needed to count the weights")
        return int(config[key])

    hidden, vocab, layers = field("hidden_size"), field("vocab_size"), field("num_hidden_layers")
    heads = field("num_attention_heads")
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    per_layer = attention + 3 * hidden * field("intermediate_size") + 2 * hidden
    tied = bool(config.get("tie_word_embeddings", False))
    embedding = vocab * hidden
    parameters = embedding * (1 if tied else 2) + layers * per_layer + hidden
    return WeightPlan(parameters, 4 * embedding if tied else 0)


@cache
def gguf_reader(path: Path):  # -> gguf.GGUFReader
    """One reader per file for a whole plan. NOTE: opening a GGUF parses its whole vocabulary (about
    20 s for Gemma 3's 262,144 tokens), and a plan asks for its shape, its weights and its config."""
    from gguf import GGUFReader  # lazy: keeps this module free of numpy for pure callers

    return GGUFReader(str(path))


def _weights_from_gguf(gguf_path: Path) -> WeightPlan:
    """Every tensor's elements, as the loader dequantizes them to float32; tied where the file has no
    output.weight (the loader's rule, pdserve/engine/weights.py)."""
    tensors = {t.name: int(t.n_elements) for t in gguf_reader(gguf_path.resolve()).tensors}
    tied = "output.weight" not in tensors
    return WeightPlan(sum(tensors.values()), 4 * tensors.get("token_embd.weight", 0) if tied else 0)


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
    fields = gguf_reader(gguf_path.resolve()).fields

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
