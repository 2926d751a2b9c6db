"""Frozen configuration for the engine, one dataclass per concern.

Each is validated where it is built; the engine composes them and hands each
component only its own part.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from pdserve.field_error import FieldError
from pdserve.settings import not_a_setting
from pdserve.settings import setting as user_setting  # NOTE: __post_init__ names a kernel field `setting`


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
# auto: the KV cache takes the model's dtype (vLLM's "auto"), resolved before anything reads it
KV_DTYPE_SETTINGS = ("auto", *KV_DTYPES)
# The weights' and activations' dtype; auto: bfloat16 on CUDA, float32 elsewhere (resolve_model_dtype)
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
CPU_KV_CACHE_GIB = 1.0  # the pool of a CPU worker given neither cache.num_blocks nor cache.kv_cache_gib
# NOTE: what the GPU rule leaves beside a step's activations for cuBLAS's workspace, the allocator's
# fragments and the kernels' scratch: none of them is allocated yet when free memory is read.
ACTIVATION_SLACK_BYTES = 256 * 2**20


@dataclass(frozen=True)
class DtypeChoice:
    """A dtype setting as resolved: what the engine runs and why (auto's device, or set)."""

    setting: str  # dtype or kv_dtype
    value: str  # never auto
    reason: str

    def describe(self) -> str:
        return f"{self.setting} {self.value} ({self.reason})"


def resolve_model_dtype(requested: str, device_type: str) -> DtypeChoice:
    """EngineConfig.dtype on a device: auto is bfloat16 on CUDA (vLLM's default for a bfloat16 or
    float32 checkpoint) and float32 on the CPU (pdserve's native kernels read float32)."""
    if requested != "auto":
        return DtypeChoice("dtype", requested, f"set: dtype {requested}")
    return DtypeChoice("dtype", "bfloat16" if device_type == "cuda" else "float32", f"auto: {device_type}")


def resolve_kv_dtype(requested: str, model_dtype: str) -> DtypeChoice:
    """CacheConfig.kv_dtype given the model's resolved dtype: auto is the model's."""
    if requested != "auto":
        return DtypeChoice("kv_dtype", requested, f"set: kv_dtype {requested}")
    return DtypeChoice("kv_dtype", model_dtype, "auto: the model's dtype")


@dataclass(frozen=True)
class DeviceMemory:
    """A GPU's memory as torch.cuda.mem_get_info reads it once the weights are loaded."""

    free_bytes: int
    total_bytes: int


def gpu_pool_blocks(free_bytes: int, total_bytes: int, utilization: float, block_bytes: int,
                    reserve_bytes: int) -> int:
    """KV blocks a GPU holds under vLLM's rule: this worker may use utilization x total bytes; what
    is in use already (its weights, its CUDA context, any other process) and the activation reserve
    come out of that, and the rest is the pool.

        pool bytes = total x utilization - (total - free) - reserve;  blocks = pool bytes // block bytes
    """
    pool_bytes = int(total_bytes * utilization) - (total_bytes - free_bytes) - reserve_bytes
    if pool_bytes < block_bytes:
        used, reserve = (total_bytes - free_bytes) / 2**30, reserve_bytes / 2**30
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization:g} x {total_bytes / 2**30:.2f} GiB, less "
            f"{used:.2f} GiB in use (weights, CUDA context, other processes) and a {reserve:.2f} GiB "
            f"activation reserve, leaves {max(pool_bytes, 0) / 2**20:.0f} MiB, under one block "
            f"({block_bytes:,} B); raise cache.gpu_memory_utilization (--gpu-memory-utilization) or set "
            "cache.num_blocks")
    return pool_bytes // block_bytes


def activation_reserve_bytes(model: ModelConfig, max_batched_tokens: int, max_num_seqs: int,
                             dtype: str) -> int:
    """What one step's activations may hold at once, kept out of a GPU pool: per batched token the
    hidden state, residual and norm (3 x hidden), the q/k/v product, and gate/up with its activation
    (3 x intermediate), in the model's dtype; per sequence its logits row in the dtype and in float32;
    and ACTIVATION_SLACK_BYTES."""
    element = KV_DTYPE_TABLE[dtype].element_bytes
    per_token = 3 * model.hidden_size + (model.num_heads + 2 * model.num_kv_heads) * model.head_dim \
        + 3 * model.intermediate_size
    logits = max_num_seqs * model.vocab_size * (element + 4)
    return max_batched_tokens * per_token * element + logits + ACTIVATION_SLACK_BYTES


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder of one of pdserve's families (names follow Hugging Face's config.json);
    the family's own parts are in pdserve/engine/families.py, the checkpoint's here."""

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
    architecture: str = "llama"  # a family of pdserve/engine/families.py
    # RoPE of the full-attention layers: default, linear (positions / factor) or llama3 (low and high
    # frequencies scaled apart, around original_max_position_embeddings)
    rope_scaling: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 0
    rope_freq_factors: tuple[float, ...] = ()  # a GGUF's rope_freqs: each inverse frequency divided by one
    rope_local_theta: float | None = None  # the sliding layers' own theta, plain RoPE (Gemma 3); None: same
    sliding_window: int | None = None  # a query attends the last sliding_window positions, itself included
    sliding_layers: tuple[int, ...] = ()  # the layers that use the window (the loaders list them all)
    query_pre_attn_scalar: float | None = None  # attention scales by its -1/2 power; None: head_dim's

    def __post_init__(self) -> None:
        for name in ("eos_token_ids", "rope_freq_factors", "sliding_layers"):  # JSON gives lists back
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")

        if self.rope_scaling not in ("default", "linear", "llama3"):
            raise ValueError(f"model config: rope_scaling must be default, linear or llama3, got "
                             f"{self.rope_scaling!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"model config: sliding_window must be >= 1, got {self.sliding_window}")
        if self.sliding_layers and self.sliding_window is None:
            raise ValueError("model config: sliding_layers are listed but sliding_window is not set")
        outside = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
        if outside:
            raise ValueError(f"model config: sliding_layers {outside} are not layers of {self.num_layers}")

    def window_of(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends within, or None (the whole context)."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, kv_dtype)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """KV bytes = 2 (K and V) x layers x kv_heads x (head_dim x bytes per element + scale bytes),
    per token; the scale is 0 bytes for float32/float16/bfloat16 and 4 for int8 and fp8."""
    if kv_dtype not in KV_DTYPE_TABLE:
        resolve = " (auto is the model's dtype, resolved first)" if kv_dtype == "auto" else ""
        raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}{resolve}")
    return 2 * num_layers * num_kv_heads * KV_DTYPE_TABLE[kv_dtype].row_bytes(head_dim)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, dtype and how many blocks the pool holds; and the tiers
    below it (engine/host_tier.py, engine/disk_tier.py), off unless sized."""

    block_size: int = user_setting(16, flag="--block-size", key="cache.block_size",
                              help="tokens per KV block; the same on every worker")
    kv_dtype: str = user_setting("auto", flag="--kv-dtype", key="cache.kv_dtype", choices=KV_DTYPE_SETTINGS,
                            help="KV cache element type: auto = the model's dtype (bfloat16 on CUDA, float32 "
                                 "on the CPU); int8 and fp8 quantize K/V per token and KV head with a "
                                 "float32 scale, about 3.8x float32's tokens")
    num_blocks: int | None = user_setting(
        None, flag="--num-blocks", key="cache.num_blocks", metavar="N",
        help="KV blocks per worker (default: as many as cache.kv_cache_gib holds, or on CUDA "
             "cache.gpu_memory_utilization leaves)")
    # None: CPU_KV_CACHE_GIB on the CPU; on CUDA the pool takes what gpu_memory_utilization leaves
    kv_cache_gib: float | None = user_setting(
        None, flag="--kv-cache-gib", key="cache.kv_cache_gib", metavar="GIB",
        help=f"KV cache memory per worker in GiB, when cache.num_blocks is not given (default: "
             f"{CPU_KV_CACHE_GIB:g} on the CPU; on CUDA what cache.gpu_memory_utilization leaves)")
    gpu_memory_utilization: float = user_setting(
        0.9, flag="--gpu-memory-utilization", key="cache.gpu_memory_utilization", metavar="FRACTION",
        help="fraction of a GPU's memory a worker may use, as vLLM's: its pool is that share of the total, "
             "less what is in use once the weights are loaded and an activation reserve; used on CUDA when "
             "neither cache.num_blocks nor cache.kv_cache_gib is given")
    enable_prefix_caching: bool = not_a_setting(True, why="the router's prefix index counts on every worker "
                                                          "caching; engine tests turn it off")
    # the host-memory tier; 0: none (an evicted block is gone)
    host_cache_gib: float = user_setting(
        0.0, flag="--host-cache-gib", key="cache.host_cache_gib", metavar="GIB",
        help="host-memory KV tier per worker in GiB: evicted blocks are copied there and loaded back on a "
             "prefix hit instead of recomputed; 0 = off (docs/deploy.md)")
    # None: derived from host_cache_gib
    host_num_blocks: int | None = not_a_setting(
        None, why="tests size the host tier in blocks; a cluster gives cache.host_cache_gib")
    disk_cache_dir: str | None = user_setting(
        None, flag="--disk-cache-dir", key="cache.disk_cache_dir", metavar="DIR",
        help="disk KV tier under the host tier, one subfolder per worker: blocks leaving host memory are "
             "written there and a restarted worker comes back warm (default: off)")
    disk_cache_gib: float = user_setting(
        4.0, flag="--disk-cache-gib", key="cache.disk_cache_gib", metavar="GIB",
        help="bound of each worker's disk tier in GiB")

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise FieldError("block_size", "must be >= 1", self.block_size)
        if self.kv_dtype not in KV_DTYPE_SETTINGS:
            raise FieldError("kv_dtype", f"must be one of {', '.join(KV_DTYPE_SETTINGS)}", self.kv_dtype)
        if self.num_blocks is not None and self.num_blocks < 1:
            raise FieldError("num_blocks", "must be >= 1", self.num_blocks)
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise FieldError("kv_cache_gib", "must be > 0", self.kv_cache_gib)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise FieldError("gpu_memory_utilization", "must be in (0, 1]", self.gpu_memory_utilization)
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

    def resolve_num_blocks(self, model: ModelConfig, gpu: DeviceMemory | None = None,
                           reserve_bytes: int = 0) -> int:
        """The pool's blocks: num_blocks; else kv_cache_gib's; else, on a GPU (gpu: its memory once the
        weights are loaded), gpu_pool_blocks's rule; else CPU_KV_CACHE_GIB's."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_cache_gib is None and gpu is not None:
            return gpu_pool_blocks(gpu.free_bytes, gpu.total_bytes, self.gpu_memory_utilization,
                                   self.block_bytes(model), reserve_bytes)
        gib = self.kv_cache_gib if self.kv_cache_gib is not None else CPU_KV_CACHE_GIB
        return max(1, int(gib * 2**30) // self.block_bytes(model))

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

    max_num_batched_tokens: int = user_setting(
        2048, flag="--max-batched-tokens", key="scheduler.max_batched_tokens", metavar="N",
        help="token budget of one engine step: the prefill chunk size")
    max_num_seqs: int = user_setting(64, flag="--max-num-seqs", key="scheduler.max_num_seqs", metavar="N",
                                help="most sequences one worker runs at once; more wait")

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise FieldError(name, "must be >= 1", getattr(self, name))


# Each kernel setting's values: auto (the default) picks native where the CPU and the built extension
# support it, else torch's (pdserve/engine/kernel_choice.py); native is pdserve's own kernels (AVX2,
# and AVX-512 where the CPU has it; pdserve/engine/cpu_kernels.py).
LINEAR_KERNELS = ("auto", "matmul", "onednn", "native")
ATTENTION_KERNELS = ("auto", "sdpa", "native", "triton")
DECODE_STEPS = ("auto", "static", "dynamic")
POINTWISE_KERNELS = ("auto", "torch", "native")
# The kernels that read float32 only: native's (pdserve/engine/cpu_kernels.py) and oneDNN's packed weights
FLOAT32_ONLY_KERNELS = ("native", "onednn")
KERNEL_ALIASES = {"avx2": "native"}  # the native kernels' name before they ran AVX-512 too


def normalize_kernel(name: str) -> str:
    """A kernel setting's value as EngineConfig keeps it: an alias becomes the name it stands for."""
    return KERNEL_ALIASES.get(name, name)



def _kernel_help(text: str) -> str:
    aliases = ", ".join(f"{alias} = {name}, its old name" for alias, name in KERNEL_ALIASES.items())
    return f"{text}; {aliases}" if aliases else text


def cpu_threads_per_worker(workers: int) -> int:
    """Torch threads each of `workers` CPU workers on this machine gets: its cores, shared out."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


@dataclass(frozen=True)
class EngineConfig:
    """Every worker's engine: the model, its KV cache, batching, kernels and threads."""

    model_path: str | None = user_setting(None, flag="--model", key="model", is_path=True, metavar="PATH",
                                     help="Hugging Face folder or .gguf file (in a config file, relative to "
                                          "the file), or a model's name: smollm2 or gemma3-270m (`make "
                                          "gemma3`) (default: the embedded SmolLM2-135M-Instruct)")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str | None = not_a_setting(None, why="cuda where the worker has a GPU (gpus_per_worker), else "
                                                 "cpu")  # None: cuda when present, else cpu
    # The weights' and activations' dtype (pdserve/engine/model.py): norms, softmax and RoPE's tables are
    # computed in float32 inside and cast back, logits come out float32, as transformers runs a model.
    dtype: str = user_setting(
        "auto", flag="--dtype", key="dtype", choices=MODEL_DTYPES,
        help="the model's weights and activations: auto = bfloat16 on CUDA, float32 on the CPU (the native "
             "kernels read float32 only: with another dtype on the CPU auto picks torch's)")
    # NOTE: one declaration of a worker's torch threads. None means torch's default to an engine alone;
    # `pdserve up` resolves it before a worker starts, to the machine's cores divided among its workers
    # (deploy/launcher.py), since only the launcher knows how many share the machine.
    num_threads: int | None = user_setting(None, flag="--torch-threads", key="torch_threads", metavar="N",
                                      help="torch intra-op threads of each CPU worker; fewer leaves cores to "
                                           "the router and clients on the same machine (default: pdserve up "
                                           "divides the machine's cores among its workers)")
    # The matmul kernel (pdserve/engine/linear.py): matmul is torch's own (what transformers runs;
    # test_oracle's 1e-4); onednn is oneDNN's, over its packed layout; native is pdserve's panel matmul.
    # onednn and native sum in other orders (greedy tokens equal to transformers' in the tests).
    linear_kernel: str = user_setting(
        "auto", flag="--linear-kernel", key="linear_kernel", choices=LINEAR_KERNELS,
        help=_kernel_help(
            "every worker's matmul kernel: auto = native where the CPU and the built extension support "
            "it, else matmul; matmul = torch's own, as transformers runs it; onednn = oneDNN's; native = "
            "pdserve's own (docs/benchmarks.md)"))
    # Attention (pdserve/engine/model.py): sdpa is torch's, over each sequence's blocks gathered into a
    # dense copy; native is pdserve's own paged kernels, for decode rows (decode_attention.cpp) and
    # prefill chunks (prefill_attention.cpp), reading the rows in the pool, float32 caches only.
    attention_kernel: str = user_setting(
        "auto", flag="--attention-kernel", key="attention_kernel", choices=ATTENTION_KERNELS,
        help=_kernel_help(
            "every worker's attention: auto = native where the CPU, the built extension and the KV dtype "
            "support it, else sdpa; sdpa = torch's, over each sequence's blocks gathered into a dense "
            "copy; native = pdserve's paged kernels, reading the rows where they lie in the pool (float32"
            " KV cache only); triton = pdserve's Triton paged kernels, every KV dtype (auto on CUDA; on "
            "the CPU only under TRITON_INTERPRET=1, for tests)"))
    # RMSNorm, the residual add, RoPE and SiLU·up (pdserve/engine/pointwise.py): torch is torch's ops
    # (bit-equal to transformers); native is pdserve's fused kernels, one pass each (norm and SiLU
    # within a few ulp of torch's).
    pointwise_kernel: str = user_setting(
        "auto", flag="--pointwise-kernel", key="pointwise_kernel", choices=POINTWISE_KERNELS,
        help=_kernel_help(
            "every worker's RMSNorm, residual add, RoPE and SiLU-up: auto = native where the CPU and the "
            "built extension support it, else torch; torch = torch's ops, as transformers runs them; "
            "native = pdserve's fused kernels, one pass over the rows each"))
    # The decode step (pdserve/engine/static_decode.py): static pads a pure-decode batch to a bucket of fixed
    # shapes (what a CUDA graph captures), dynamic builds each step's tensors at its own size.
    decode_step: str = not_a_setting("auto", why="auto: static on CUDA, dynamic on the CPU (padding costs "
                                                 "the CPU and there is no graph to replay); tests and "
                                                 "bench.gpu_check set static to run it on the CPU")
    enforce_eager: bool = user_setting(
        False, flag="--enforce-eager", key="enforce_eager",
        help="never capture CUDA graphs: on CUDA a pure-decode step is otherwise captured once per batch "
             "bucket and replayed (less launch overhead); eager runs the same static step op by op")
    # On the CPU, keep freed memory in the process (pdserve/engine/cpu_allocator.py): a step's large
    # temporaries reuse mapped pages instead of faulting fresh ones in. Process-wide once set.
    retain_freed_memory: bool = not_a_setting(True, why="the allocator's behaviour, process-wide; "
                                                        "benchmarks turn it off to measure it")

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise FieldError("num_threads", "must be >= 1", self.num_threads)
        for setting, known in (("linear_kernel", LINEAR_KERNELS), ("attention_kernel", ATTENTION_KERNELS),
                               ("pointwise_kernel", POINTWISE_KERNELS)):
            value = normalize_kernel(getattr(self, setting))
            if value not in known:
                raise FieldError(setting, f"must be one of {', '.join(known)}", getattr(self, setting))
            object.__setattr__(self, setting, value)  # NOTE: frozen; the one place an alias becomes its name
        if self.decode_step not in DECODE_STEPS:
            raise FieldError("decode_step", f"must be one of {', '.join(DECODE_STEPS)}", self.decode_step)
        if self.dtype not in MODEL_DTYPES:
            raise FieldError("dtype", f"must be one of {', '.join(MODEL_DTYPES)}", self.dtype)
        self._check_float32_kernels()
        # NOTE: auto is checked once resolved: resolved() builds a config of concrete dtypes, checked here
        if self.attention_kernel == "native" and self.cache.kv_dtype not in ("float32", "auto"):
            raise FieldError("attention_kernel", f"must be sdpa or auto with kv_dtype {self.cache.kv_dtype} "
                             "(native reads float32 K/V rows only: use kv_dtype float32 for it)",
                             self.attention_kernel)

    def _check_float32_kernels(self) -> None:
        """An explicit native kernel (or onednn) reads float32 only: refused with a concrete other dtype."""
        if self.dtype in ("auto", "float32"):
            return
        for setting in ("linear_kernel", "attention_kernel", "pointwise_kernel"):
            if getattr(self, setting) in FLOAT32_ONLY_KERNELS:
                raise FieldError(setting, f"must not be {getattr(self, setting)} with dtype {self.dtype} (it "
                                 "reads float32 only): use auto or torch's, or dtype float32",
                                 getattr(self, setting))

    def resolved(self, device_type: str) -> tuple[EngineConfig, tuple[DtypeChoice, DtypeChoice]]:
        """This config with dtype and cache.kv_dtype resolved for a device (auto: resolve_model_dtype,
        resolve_kv_dtype) and checked again, and each choice with its reason."""
        dtype = resolve_model_dtype(self.dtype, device_type)
        kv_dtype = resolve_kv_dtype(self.cache.kv_dtype, dtype.value)
        config = replace(self, dtype=dtype.value, cache=replace(self.cache, kv_dtype=kv_dtype.value))
        return config, (dtype, kv_dtype)
