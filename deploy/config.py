"""A cluster's topology: the frozen ClusterSpec, and the YAML file that gives it (`pdserve up --config`).

    FILE --yaml.safe_load--> nested mapping --check every key and type--> field paths and values
         --flags given on the command line replace theirs--> ClusterSpec (each part checks its values)

One configuration tree: ClusterSpec composes the engine's CacheConfig and SchedulerConfig
(pdserve/engine/config.py), the router's PlacementConfig, RequestDeadlines, MigrationPolicy (router/config.py)
and RequestLimits (router/limits.py), the TLS files (pdserve/security/files.py), the audit
schedule (pdserve/worker/scrubber.py) and the SamplingOverrides over the model's sampling defaults
(pdserve/engine/sampling_defaults.py), so each setting and its default is declared once, where
it is used. A file key or a flag names a field path ("cache.block_size",
"limits.max_concurrent_streams"); a part that refuses a value raises a FieldError, which is
re-worded here with the key and the flag the user wrote: `cache.kv_dtype (--kv-dtype) must be
one of float32, float16, bfloat16, got 'int8'`.

Pure: yaml, dataclasses and those pure config modules only, no Ray, Redis or gRPC, so a bad file
fails in milliseconds, before anything starts. Errors name the file and the key: `local.yaml:
unknown key 'prefil' (did you mean 'prefill'?)`. The schema, one line per key, is `FILE_KEYS`
below; the flags are `FLAG_FIELDS`; deploy/examples/*.yaml show the file with comments,
docs/deploy.md explains it.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pdserve.engine.config import (
    ATTENTION_KERNELS,
    LINEAR_KERNELS,
    POINTWISE_KERNELS,
    CacheConfig,
    SchedulerConfig,
)
from pdserve.engine.hashing import CACHE_ISOLATION
from pdserve.engine.sampling_defaults import SamplingOverrides
from pdserve.field_error import FieldError
from pdserve.roles import ROLES
from pdserve.security.files import TLSFiles
from pdserve.transfer.frames import KVFrames
from pdserve.worker.scrubber import AuditSchedule
from router.config import MigrationPolicy, PlacementConfig, RequestDeadlines
from router.limits import RequestLimits

# actor_placement -> Ray scheduling_strategy: spread puts worker actors on different nodes where
# their resources allow; pack lets Ray fill one node first (its default).
ACTOR_PLACEMENTS = {"pack": "DEFAULT", "spread": "SPREAD"}
_RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
# Set in every worker process unless worker_env says otherwise. MALLOC_ARENA_MAX: glibc gives each
# thread that allocates its own malloc arena and rarely returns their free memory; a worker's
# gRPC threads then grew its RSS by ~70 MiB over 6 minutes of load, flat with 2 arenas
# (docs/reliability.md, soak control runs). OMP_WAIT_POLICY: torch's OpenMP threads spin at every
# barrier by default; on cores shared with the router, the gRPC threads or another worker, a
# spinning thread holds a core while the thread it waits for is descheduled: beside one busy
# process a decode step took twice its time (docs/benchmarks.md, "OpenMP's wait policy",
# bench.omp_wait_policy). PASSIVE threads sleep.
# Read when torch loads, so it must be in the environment the process starts with.
DEFAULT_WORKER_ENV = {"MALLOC_ARENA_MAX": "2", "OMP_WAIT_POLICY": "PASSIVE"}


@dataclass(frozen=True)
class ClusterSpec:
    model_path: str | None = None
    num_prefill: int = 1
    num_decode: int = 1
    # Router replicas over the same Redis index and registry; router i serves on port + i (and
    # http_port + i, metrics_port + i where those are set): router 0 in the launcher, the others as
    # Ray actors (router/actor.py).
    num_routers: int = 1
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = 0  # router's Prometheus port; 0 = any free port, None = none
    http_port: int = 8000  # the router's OpenAI-compatible HTTP API; 0 = off
    served_model_name: str | None = None  # the HTTP API's model name; None = the model's (weights.py)
    redis_url: str | None = field(default=None, repr=False)  # may hold a password: not in repr()
    ray_address: str | None = None  # None = start a local Ray; "auto" = the running cluster
    cache: CacheConfig = field(default_factory=CacheConfig)  # every worker's KV cache
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # every worker's batching
    placement: PlacementConfig = field(default_factory=PlacementConfig)  # the router's request placement
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may ask of the router
    deadlines: RequestDeadlines = field(default_factory=RequestDeadlines)  # the router's request deadlines
    migration: MigrationPolicy = field(default_factory=MigrationPolicy)  # streams whose decode worker breaks
    kv_frames: KVFrames = field(default_factory=KVFrames)  # how prefill workers cut KV transfers
    actor_placement: str = "pack"  # how Ray places the worker actors: ACTOR_PLACEMENTS
    linear_kernel: str = "matmul"  # every worker's matmul kernel: LINEAR_KERNELS (pdserve/engine/linear.py)
    attention_kernel: str = "sdpa"  # every worker's attention: ATTENTION_KERNELS (engine/model.py)
    pointwise_kernel: str = "torch"  # every worker's norm/RoPE/SiLU: POINTWISE_KERNELS (engine/pointwise.py)
    # NOTE: None decides at start: 1 when the cluster has a GPU for every worker, else 0 (CPU). An
    # autoscaling cluster has no GPU node yet at start, so its config says 1 explicitly.
    gpus_per_worker: float | None = None
    # torch intra-op threads of each CPU worker; None = the machine's cores divided among its workers.
    # Fewer leaves cores to the router and clients on the same machine (vLLM's CPU build keeps one).
    torch_threads: int | None = None
    namespace: str = "pdserve"
    # -1: Ray restarts a dead worker every time, as a serving cluster must; N >= 0: at most N times.
    max_restarts: int = -1
    worker_env: dict[str, str] = field(default_factory=dict)  # over DEFAULT_WORKER_ENV, in each worker
    startup_timeout_s: float = 600.0
    actor_resources: dict[str, dict[str, float]] = field(default_factory=dict)  # role -> custom resources
    # Security (docs/security.md): file paths, read when the cluster starts; None = off.
    tls: TLSFiles = field(default_factory=TLSFiles)  # what the router and every worker serve and trust
    api_token_file: str | None = None  # the router's accepted bearer tokens, one per line
    cluster_secret_file: str | None = None  # the secret of the internal services, one line
    # none: any request may reuse any other's cached prefix; token: only requests of the same API token
    # (router/server.py RouterConfig.cache_isolation; docs/security.md weighs the two). token needs
    # api_token_file.
    cache_isolation: str = "none"
    audit: AuditSchedule = field(default_factory=AuditSchedule)  # the background KV audit on every worker
    # Debug only, no flag sets it: every decode worker holds each stream once it has sent this many
    # tokens, until its actor's release_hold() (decode_worker/faults.py; the fault suite uses it).
    decode_hold_after_tokens: int | None = None
    # Over the model's sampling defaults (its generation_config.json, or SmolLM2's model card): what
    # the router gives a request that leaves temperature, top_p or top_k unset. None keeps the model's.
    sampling_overrides: SamplingOverrides = field(default_factory=SamplingOverrides)

    def __post_init__(self) -> None:
        if self.num_decode < 1:
            raise ValueError(f"decode.count (--decode) must be >= 1, got {self.num_decode}")
        if self.num_prefill < 0:
            raise ValueError(f"prefill.count (--prefill) must be >= 0, got {self.num_prefill}")
        if self.num_routers < 1:
            raise ValueError(f"router.count (--routers) must be >= 1, got {self.num_routers}")
        for name, port in (("router.port (--port)", self.port),
                           ("router.metrics_port (--metrics-port)", self.metrics_port),
                           ("router.http_port (--http-port)", self.http_port)):
            if port is not None and not 0 <= port < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        self._check_parts()
        _check_choice("actor_placement (--actor-placement)", self.actor_placement, tuple(ACTOR_PLACEMENTS))
        _check_choice("linear_kernel (--linear-kernel)", self.linear_kernel, LINEAR_KERNELS)
        _check_choice("attention_kernel (--attention-kernel)", self.attention_kernel, ATTENTION_KERNELS)
        _check_choice("pointwise_kernel (--pointwise-kernel)", self.pointwise_kernel, POINTWISE_KERNELS)
        if self.attention_kernel == "avx2" and self.cache.kv_dtype != "float32":
            raise ValueError("attention_kernel (--attention-kernel) avx2 reads float32 K/V rows only, but "
                             f"cache.kv_dtype (--kv-dtype) is {self.cache.kv_dtype}: "
                             "use sdpa, or kv_dtype float32")
        _check_choice("router.cache_isolation (--cache-isolation)", self.cache_isolation, CACHE_ISOLATION)
        if self.cache_isolation == "token" and self.api_token_file is None:
            raise ValueError("router.cache_isolation (--cache-isolation) token keeps each API token's cache "
                             "apart, so it needs auth.api_token_file (--api-token-file)")
        if self.gpus_per_worker is not None and self.gpus_per_worker < 0:
            raise ValueError(f"gpus_per_worker (--gpus-per-worker) must be >= 0, got {self.gpus_per_worker}")
        for role, resources in self.actor_resources.items():
            _check_choice("the role of actor_resources", role, ROLES)
            for name, amount in resources.items():
                if name in _RAY_BUILTIN_RESOURCES:
                    raise ValueError(f"{role}.resources.{name}: Ray takes {name} as an argument of its own, "
                                     "not a custom resource; use gpus_per_worker for GPUs")
                if amount < 0:
                    raise ValueError(f"{role}.resources.{name} must be >= 0, got {amount}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads (--torch-threads) must be >= 1, got {self.torch_threads}")
        if self.max_restarts < -1:
            raise ValueError(f"max_restarts must be -1 (always restart) or >= 0, got {self.max_restarts}")
        for name, value in self.worker_env.items():
            if not isinstance(name, str) or not isinstance(value, str) or not name or "=" in name:
                raise ValueError(f"worker_env: {name!r}: {value!r} must map a variable name to a string "
                                 "(quote numbers in YAML: MALLOC_ARENA_MAX: \"4\")")
        self._check_tls()

    def _check_parts(self) -> None:
        """Each part is its own config dataclass (it checks its values); refuse anything else, such as
        a value meant for a field of the part."""
        for f in fields(self):
            part = _PARTS.get(f.name)
            if part is not None and not isinstance(getattr(self, f.name), part):
                raise TypeError(f"ClusterSpec.{f.name} must be a {part.__name__}, got "
                                f"{getattr(self, f.name)!r}")

    @property
    def worker_environment(self) -> dict[str, str]:
        return {**DEFAULT_WORKER_ENV, **self.worker_env}

    def _check_tls(self) -> None:
        """Which TLS settings go together; whether the files exist is checked when the cluster starts."""
        tls = self.tls
        if (tls.cert is None) != (tls.key is None):
            raise ValueError("tls.cert (--tls-cert) and tls.key (--tls-key) go together: give both or "
                             "neither")
        if (tls.client_cert is None) != (tls.client_key is None):
            raise ValueError("tls.client_cert (--tls-client-cert) and tls.client_key (--tls-client-key) go "
                             "together: give both or neither")
        needs_cert = {"tls.ca (--tls-ca)": tls.ca is not None,
                      "tls.require_client_cert (--tls-require-client-cert)": tls.require_client_cert,
                      "tls.client_cert (--tls-client-cert)": tls.client_cert is not None}
        given = [name for name, on in needs_cert.items() if on]
        if tls.cert is None and given:
            raise ValueError(f"{', '.join(given)} needs tls.cert and tls.key (--tls-cert, --tls-key): "
                             "the cluster serves TLS only with a certificate")
        if tls.require_client_cert and (tls.ca is None or tls.client_cert is None):
            raise ValueError("tls.require_client_cert (--tls-require-client-cert) needs tls.ca (--tls-ca), "
                             "the CA of the client certificates, and tls.client_cert/tls.client_key "
                             "(--tls-client-cert/--tls-client-key), the certificate the router and prefill "
                             "workers present to the workers (client.pem from `python -m "
                             "pdserve.security.certs`)")

    @property
    def scheduling_strategy(self) -> str:
        return ACTOR_PLACEMENTS[self.actor_placement]


_PARTS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "placement": PlacementConfig,
          "limits": RequestLimits, "deadlines": RequestDeadlines, "migration": MigrationPolicy,
          "tls": TLSFiles, "audit": AuditSchedule,
          "kv_frames": KVFrames, "sampling_overrides": SamplingOverrides}


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


# --- the file and the flags ----------------------------------------------------------------------

_NONE = type(None)
_NUMBER = (int, float)
_PATH = (str, _NONE)
# dotted key in the file -> (ClusterSpec field path, accepted types); a section is the part before the
# dot. A path with a dot is a field of one of ClusterSpec's parts ("cache.block_size": CacheConfig's).
FILE_KEYS: dict[str, tuple[str, tuple[type, ...]]] = {
    "model": ("model_path", (str, _NONE)),
    "host": ("host", (str,)),
    "prefill.count": ("num_prefill", (int,)),
    "prefill.resources": ("actor_resources", (dict,)),
    "prefill.max_chunk_bytes": ("kv_frames.max_chunk_bytes", (int,)),
    "decode.count": ("num_decode", (int,)),
    "decode.resources": ("actor_resources", (dict,)),
    "actor_placement": ("actor_placement", (str,)),
    "linear_kernel": ("linear_kernel", (str,)),
    "attention_kernel": ("attention_kernel", (str,)),
    "pointwise_kernel": ("pointwise_kernel", (str,)),
    "gpus_per_worker": ("gpus_per_worker", (int, float, _NONE)),
    "torch_threads": ("torch_threads", (int, _NONE)),
    "cache.block_size": ("cache.block_size", (int,)),
    "cache.kv_dtype": ("cache.kv_dtype", (str,)),
    "cache.kv_cache_gib": ("cache.kv_cache_gib", _NUMBER),
    "cache.num_blocks": ("cache.num_blocks", (int, _NONE)),
    "cache.host_cache_gib": ("cache.host_cache_gib", _NUMBER),
    "cache.disk_cache_dir": ("cache.disk_cache_dir", (str, _NONE)),
    "cache.disk_cache_gib": ("cache.disk_cache_gib", _NUMBER),
    "scheduler.max_batched_tokens": ("scheduler.max_num_batched_tokens", (int,)),
    "router.count": ("num_routers", (int,)),
    "router.port": ("port", (int,)),
    "router.metrics_port": ("metrics_port", (int, _NONE)),
    "router.http_port": ("http_port", (int,)),
    "router.served_model_name": ("served_model_name", (str, _NONE)),
    "router.routing": ("placement.routing", (str,)),
    "router.min_remote_prefill_tokens": ("placement.min_remote_prefill_tokens", (int,)),
    "router.max_in_flight_per_decode": ("placement.max_in_flight_per_decode", (int,)),
    "router.max_prompt_tokens": ("limits.max_prompt_tokens", (int, _NONE)),
    "router.max_tokens_limit": ("limits.max_tokens_limit", (int,)),
    "router.max_message_bytes": ("limits.max_message_bytes", (int,)),
    "router.max_concurrent_streams": ("limits.max_concurrent_streams", (int,)),
    "router.cache_isolation": ("cache_isolation", (str,)),
    "router.prefill_deadline_fraction": ("deadlines.prefill_deadline_fraction", _NUMBER),
    "router.prefill_timeout_s": ("deadlines.prefill_timeout_s", _NUMBER),
    "router.migration_limit": ("migration.limit", (int,)),
    "redis_url": ("redis_url", (str, _NONE)),
    "ray_address": ("ray_address", (str, _NONE)),
    "namespace": ("namespace", (str,)),
    "max_restarts": ("max_restarts", (int,)),
    "worker_env": ("worker_env", (dict,)),
    "tls.cert": ("tls.cert", _PATH),
    "tls.key": ("tls.key", _PATH),
    "tls.ca": ("tls.ca", _PATH),
    "tls.require_client_cert": ("tls.require_client_cert", (bool,)),
    "tls.client_cert": ("tls.client_cert", _PATH),
    "tls.client_key": ("tls.client_key", _PATH),
    "auth.api_token_file": ("api_token_file", _PATH),
    "auth.cluster_secret_file": ("cluster_secret_file", _PATH),
    "audit.interval_s": ("audit.interval_s", (int, float, _NONE)),
    "audit.max_fraction": ("audit.max_fraction", _NUMBER),
    "default_temperature": ("sampling_overrides.temperature", (int, float, _NONE)),
    "default_top_p": ("sampling_overrides.top_p", (int, float, _NONE)),
    "default_top_k": ("sampling_overrides.top_k", (int, _NONE)),
}
# Keys a file may no longer use: the error names the new key (a silent alias would be a second name).
RENAMED_KEYS = {"placement": ("actor_placement", "pack or spread: how Ray places the worker actors")}
# `pdserve up` flags (argparse dests) -> the ClusterSpec field paths they set; most are the file's
# key without its section, spelled --with-dashes.
FLAG_FIELDS: dict[str, str] = {
    "model": "model_path", "prefill": "num_prefill", "decode": "num_decode", "routers": "num_routers",
    "actor_placement": "actor_placement", "gpus_per_worker": "gpus_per_worker",
    "torch_threads": "torch_threads",
    "linear_kernel": "linear_kernel", "attention_kernel": "attention_kernel",
    "pointwise_kernel": "pointwise_kernel",
    "host": "host", "port": "port", "metrics_port": "metrics_port", "redis_url": "redis_url",
    "http_port": "http_port", "served_model_name": "served_model_name",
    "address": "ray_address", "namespace": "namespace",
    "block_size": "cache.block_size", "kv_dtype": "cache.kv_dtype", "num_blocks": "cache.num_blocks",
    "kv_cache_gib": "cache.kv_cache_gib", "host_cache_gib": "cache.host_cache_gib",
    "disk_cache_dir": "cache.disk_cache_dir", "disk_cache_gib": "cache.disk_cache_gib",
    "max_batched_tokens": "scheduler.max_num_batched_tokens",
    "routing": "placement.routing", "min_remote_prefill_tokens": "placement.min_remote_prefill_tokens",
    "max_prompt_tokens": "limits.max_prompt_tokens", "max_tokens_limit": "limits.max_tokens_limit",
    "max_message_bytes": "limits.max_message_bytes",
    "max_concurrent_streams": "limits.max_concurrent_streams",
    "prefill_deadline_fraction": "deadlines.prefill_deadline_fraction",
    "prefill_timeout_s": "deadlines.prefill_timeout_s", "migration_limit": "migration.limit",
    "cache_isolation": "cache_isolation",
    "tls_cert": "tls.cert", "tls_key": "tls.key", "tls_ca": "tls.ca",
    "tls_require_client_cert": "tls.require_client_cert", "tls_client_cert": "tls.client_cert",
    "tls_client_key": "tls.client_key", "api_token_file": "api_token_file",
    "cluster_secret_file": "cluster_secret_file", "audit_interval_s": "audit.interval_s",
    "audit_max_fraction": "audit.max_fraction", "max_chunk_bytes": "kv_frames.max_chunk_bytes",
    "default_temperature": "sampling_overrides.temperature", "default_top_p": "sampling_overrides.top_p",
    "default_top_k": "sampling_overrides.top_k"}
# Fields that name a file: a relative path in the file is relative to the file.
PATH_FIELDS = ("model_path", "tls.cert", "tls.key", "tls.ca", "tls.client_cert", "tls.client_key",
               "api_token_file", "cluster_secret_file")
_SECTIONS = sorted({key.split(".")[0] for key in FILE_KEYS if "." in key})
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", dict: "a mapping", _NONE: "null",
               bool: "true or false"}


def load_config(path: str | os.PathLike) -> ClusterSpec:
    """Read a topology file; every key it leaves out keeps ClusterSpec's default."""
    import yaml  # here, not at the top: `pdserve --help` imports this module

    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        try:
            document = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
    return spec_from_mapping(document if document is not None else {}, path)


def spec_from_mapping(document: Any, path: str = "<config>") -> ClusterSpec:
    values = _flatten(document, path)
    fields_: dict[str, Any] = {}
    resources: dict[str, dict[str, float]] = {}
    for key, value in values.items():
        name, types = FILE_KEYS[key]
        _check_type(path, key, value, types)
        if name == "actor_resources":
            if value:  # `resources: {}` requires nothing, like leaving it out
                resources[key.split(".")[0]] = _resources(path, key, value)
        else:
            fields_[name] = value
    if resources:
        fields_["actor_resources"] = resources
    for name in PATH_FIELDS:
        value = fields_.get(name)
        if value is not None and not os.path.isabs(os.path.expanduser(value)):
            # NOTE: relative to the file, not to wherever `pdserve up` runs, so a file travels with its
            # model and certificates.
            fields_[name] = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), value))
    try:
        return _compose(ClusterSpec(), fields_)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def with_overrides(spec: ClusterSpec, overrides: Mapping[str, Any]) -> ClusterSpec:
    """spec with the field paths given on the command line (None = not given) replaced."""
    return _compose(spec, {path: value for path, value in overrides.items() if value is not None})


def _compose(base: ClusterSpec, values: Mapping[str, Any]) -> ClusterSpec:
    """base with values (field path -> value) replaced; a part that refuses a value is named by the
    key and flag that set it."""
    top: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        part, _, name = path.partition(".")
        if name:
            parts.setdefault(part, {})[name] = value
        else:
            top[path] = value
    for part, changes in parts.items():
        try:
            top[part] = replace(getattr(base, part), **changes)
        except FieldError as exc:
            raise ValueError(exc.named(field_label(f"{part}.{exc.field}"))) from None
    return replace(base, **top)


def field_label(path: str) -> str:
    """How a user names a field: its file key and flag, 'cache.kv_dtype (--kv-dtype)'."""
    key = next((k for k, (p, _) in FILE_KEYS.items() if p == path), path)
    flag = next((f"--{dest.replace('_', '-')}" for dest, p in FLAG_FIELDS.items() if p == path), None)
    return f"{key} ({flag})" if flag else key


def _flatten(document: Any, path: str) -> dict[str, Any]:
    if not isinstance(document, dict):
        raise ValueError(f"{path}: expected a mapping of keys ({', '.join(_top_keys())}), "
                         f"got {type(document).__name__}")
    out: dict[str, Any] = {}
    for key, value in document.items():
        key = str(key)
        if key in _SECTIONS:
            section = value if value is not None else {}
            if not isinstance(section, dict):
                raise ValueError(f"{path}: '{key}' must be a mapping of "
                                 f"{', '.join(_section_keys(key))}, got {section!r}")
            for sub, sub_value in section.items():
                dotted = f"{key}.{sub}"
                if dotted not in FILE_KEYS:
                    _unknown(path, dotted, [f"{key}.{k}" for k in _section_keys(key)])
                out[dotted] = sub_value
        elif key in FILE_KEYS:
            out[key] = value
        elif key in RENAMED_KEYS:
            new, meaning = RENAMED_KEYS[key]
            raise ValueError(f"{path}: '{key}' is now '{new}' ({meaning}); rename it in the file")
        else:
            _unknown(path, key, _top_keys())
    return out


def _top_keys() -> list[str]:
    return list(dict.fromkeys(key.split(".")[0] for key in FILE_KEYS))


def _section_keys(section: str) -> list[str]:
    return [key.split(".", 1)[1] for key in FILE_KEYS if key.startswith(section + ".")]


def _unknown(path: str, key: str, known: list[str]) -> None:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"
    raise ValueError(f"{path}: unknown key '{key}' ({hint})")


def _check_type(path: str, key: str, value: Any, types: tuple[type, ...]) -> None:
    # NOTE: YAML reads `yes`/`on` as True, and bool is an int in Python: only a flag key takes one.
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        names = [_TYPE_NAMES[t] for t in types if not (t is int and float in types)]
        wanted = " or ".join(names)
        raise ValueError(f"{path}: '{key}' must be {wanted}, got {value!r} ({type(value).__name__})")


def _resources(path: str, key: str, value: dict) -> dict[str, float]:
    out = {}
    for name, amount in value.items():
        if isinstance(amount, bool) or not isinstance(amount, _NUMBER):
            raise ValueError(f"{path}: '{key}.{name}' must be a number (units of the Ray resource), "
                             f"got {amount!r}")
        out[str(name)] = float(amount)
    return out
