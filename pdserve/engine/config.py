"""Frozen configuration for the engine, one dataclass per concern.

Each is validated where it is built; the engine composes them and hands each
component only its own part.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from pdserve.field_error import FieldError


@dataclass(frozen=True)
class KVDtype:
    """How one K (or V) row of one token and one KV head is stored: head_dim elements of
    element_bytes, and scale_bytes beside them (the quantized dtypes' scale, and int8's offset).

    row_format names the encoding of the rows. It stands for the dtype in the engine salt and the
    KV wire layout, so that rows of two encodings of one dtype never meet (a peer, a disk file or a
    block hash of int8's first encoding against this one). A dtype's first encoding is named as
    the dtype, so its salt never changed."""

    element_bytes: int
    row_format: str
    scale_bytes: int = 0

    def row_bytes(self, head_dim: int) -> int:
        return head_dim * self.element_bytes + self.scale_bytes


# The KV cache's element types, the one dtype table: float32/float16/bfloat16 as torch names them;
# fp8 (torch.float8_e4m3fn) is a symmetric per-token, per-KV-head quantization with a float32 scale
# per row; int8 quantizes each row Hadamard-rotated, with a float16 scale and offset, and a query
# attends its own row unquantized (pdserve/engine/kv_format.py holds their torch side).
KV_DTYPE_TABLE = {"float32": KVDtype(4, "float32"), "float16": KVDtype(2, "float16"),
                  "bfloat16": KVDtype(2, "bfloat16"), "int8": KVDtype(1, "int8-hadamard-affine-own-row", 4),
                  "fp8": KVDtype(1, "fp8", 4)}
KV_DTYPES = tuple(KV_DTYPE_TABLE)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (names follow Hugging Face's config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, kv_dtype)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """KV bytes = 2 (K and V) x layers x kv_heads x (head_dim x bytes per element + scale bytes),
    per token; the scale is 0 bytes for float32/float16/bfloat16 and 4 for int8 and fp8."""
    if kv_dtype not in KV_DTYPE_TABLE:
        raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    return 2 * num_layers * num_kv_heads * KV_DTYPE_TABLE[kv_dtype].row_bytes(head_dim)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, dtype and how many blocks the pool holds; and the tiers
    below it (engine/host_tier.py, engine/disk_tier.py), off unless sized."""

    block_size: int = 16
    kv_dtype: str = "float32"
    num_blocks: int | None = None  # None: derived from kv_cache_gib
    kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    host_cache_gib: float = 0.0  # the host-memory tier; 0: none (an evicted block is gone)
    host_num_blocks: int | None = None  # None: derived from host_cache_gib
    disk_cache_dir: str | None = None  # the disk tier under the host tier; None: none
    disk_cache_gib: float = 4.0  # the disk tier's bound

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise FieldError("block_size", "must be >= 1", self.block_size)
        if self.kv_dtype not in KV_DTYPES:
            raise FieldError("kv_dtype", f"must be one of {', '.join(KV_DTYPES)}", self.kv_dtype)
        if self.num_blocks is not None and self.num_blocks < 1:
            raise FieldError("num_blocks", "must be >= 1", self.num_blocks)
        if self.kv_cache_gib <= 0:
            raise FieldError("kv_cache_gib", "must be > 0", self.kv_cache_gib)
        if not self.host_cache_gib >= 0:
            raise FieldError("host_cache_gib", "must be >= 0 (0: no host tier)", self.host_cache_gib)
        if self.host_num_blocks is not None and self.host_num_blocks < 0:
            raise FieldError("host_num_blocks", "must be >= 0", self.host_num_blocks)
        if not self.disk_cache_gib > 0:
            raise FieldError("disk_cache_gib", "must be > 0", self.disk_cache_gib)
        if self.disk_cache_dir is not None and not (self.host_cache_gib or self.host_num_blocks):
            raise FieldError("disk_cache_dir", "needs a host tier above it (blocks reach disk as they "
                             "leave host memory); set host_cache_gib > 0", self.disk_cache_dir)

    def for_worker(self, worker_id: str) -> CacheConfig:
        """This config for one worker: its disk tier in a subfolder of its own (a restarted worker
        keeps its id, so it finds its files again; two workers never share one)."""
        if self.disk_cache_dir is None:
            return self
        return replace(self, disk_cache_dir=os.path.join(self.disk_cache_dir, worker_id))

    def resolve_num_blocks(self, model: ModelConfig) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return max(1, int(self.kv_cache_gib * 2**30) // self.block_bytes(model))

    def block_bytes(self, model: ModelConfig) -> int:
        return model.kv_bytes_per_token(self.kv_dtype) * self.block_size

    def resolve_host_blocks(self, model: ModelConfig) -> int:
        """Slots of the host tier; 0: no host tier."""
        if self.host_num_blocks is not None:
            return self.host_num_blocks
        return int(self.host_cache_gib * 2**30) // self.block_bytes(model)

    def resolve_disk_blocks(self, model: ModelConfig) -> int:
        return max(1, int(self.disk_cache_gib * 2**30) // self.block_bytes(model))


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching: a token budget per step (chunked prefill) and a cap on sequences."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise FieldError(name, "must be >= 1", getattr(self, name))


LINEAR_KERNELS = ("matmul", "onednn", "avx2")
ATTENTION_KERNELS = ("sdpa", "avx2")
POINTWISE_KERNELS = ("torch", "avx2")


def cpu_threads_per_worker(workers: int) -> int:
    """Torch threads each of `workers` CPU workers on this machine gets: its cores, shared out."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str | None = None  # None: cuda when present, else cpu
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    # The matmul kernel (pdserve/engine/linear.py): matmul is torch's own (what transformers runs;
    # test_oracle's 1e-4); onednn is 2-3x faster for prefill and batched decode on x86 CPUs but sums in
    # another order (logits within 5e-3 of transformers', greedy tokens equal in the tests).
    linear_kernel: str = "matmul"
    # Attention (pdserve/engine/model.py): sdpa is torch's, over each sequence's blocks gathered into a
    # dense copy; avx2 is pdserve's own paged kernels, for decode rows (decode_attention.cpp) and
    # prefill chunks (prefill_attention.cpp), reading the rows in the pool, float32 caches only.
    attention_kernel: str = "sdpa"
    # RMSNorm, the residual add, RoPE and SiLU·up (pdserve/engine/pointwise.py): torch is torch's ops
    # (bit-equal to transformers); avx2 is pdserve's fused kernels, one pass each (norm and SiLU within
    # a few ulp of torch's).
    pointwise_kernel: str = "torch"
    # On the CPU, keep freed memory in the process (pdserve/engine/cpu_allocator.py): a step's large
    # temporaries reuse mapped pages instead of faulting fresh ones in. Process-wide once set.
    retain_freed_memory: bool = True

    def __post_init__(self) -> None:
        if self.linear_kernel not in LINEAR_KERNELS:
            raise FieldError("linear_kernel", f"must be one of {', '.join(LINEAR_KERNELS)}",
                             self.linear_kernel)
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise FieldError("attention_kernel", f"must be one of {', '.join(ATTENTION_KERNELS)}",
                             self.attention_kernel)
        if self.pointwise_kernel not in POINTWISE_KERNELS:
            raise FieldError("pointwise_kernel", f"must be one of {', '.join(POINTWISE_KERNELS)}",
                             self.pointwise_kernel)
        if self.attention_kernel == "avx2" and self.cache.kv_dtype != "float32":
            raise FieldError("attention_kernel", f"must be sdpa with kv_dtype {self.cache.kv_dtype} (avx2 "
                             "reads float32 K/V rows only: use kv_dtype float32 for it)",
                             self.attention_kernel)
