"""A cluster's topology: the frozen ClusterSpec, and the YAML file that gives it (`pdserve up --config`).

    FILE --yaml.safe_load--> nested mapping --check every key and type--> ClusterSpec fields
         --flags given on the command line replace their fields--> ClusterSpec (__post_init__ checks values)

Pure: yaml and dataclasses only, no Ray, Redis or gRPC, so a bad file fails in milliseconds,
before anything starts. Errors name the file and the key: `local.yaml: unknown key 'prefil'
(did you mean 'prefill'?)`. The schema, one line per key, is `FILE_KEYS` below;
deploy/examples/*.yaml show it with comments, docs/deploy.md explains it.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.engine.config import KV_DTYPES
from pdserve.engine.hashing import CACHE_ISOLATION
from pdserve.roles import ROLES
from pdserve.worker.scrubber import DEFAULT_MAX_FRACTION, check_scrubber_settings

# NOTE: mirrors router.placement.POLICIES (a test pins it); importing the router would pull gRPC
# into `pdserve --help` and into this pure module.
ROUTING_POLICIES = ("prefix", "least_load", "round_robin")
# placement -> Ray scheduling_strategy: spread puts actors on different nodes where their
# resources allow; pack lets Ray fill one node first (its default).
PLACEMENTS = {"pack": "DEFAULT", "spread": "SPREAD"}
_RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
# Set in every worker process unless worker_env says otherwise. MALLOC_ARENA_MAX: glibc gives each
# thread that allocates its own malloc arena and rarely returns their free memory; a worker's
# gRPC threads then grew its RSS by ~70 MiB over 6 minutes of load, flat with 2 arenas
# (docs/reliability.md, soak control runs).
DEFAULT_WORKER_ENV = {"MALLOC_ARENA_MAX": "2"}


@dataclass(frozen=True)
class ClusterSpec:
    model_path: str | None = None
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = 0  # router's Prometheus port; 0 = any free port, None = none
    redis_url: str | None = field(default=None, repr=False)  # may hold a password: not in repr()
    ray_address: str | None = None  # None = start a local Ray; "auto" = the running cluster
    block_size: int = 16
    kv_dtype: str = "float32"
    num_blocks: int | None = None
    kv_cache_gib: float = 1.0
    max_batched_tokens: int = 2048
    min_remote_prefill_tokens: int = 32
    routing: str = "prefix"
    max_in_flight_per_decode: int = 64
    placement: str = "pack"
    # NOTE: None decides at start: 1 when the cluster has a GPU for every worker, else 0 (CPU). An
    # autoscaling cluster has no GPU node yet at start, so its config says 1 explicitly.
    gpus_per_worker: float | None = None
    namespace: str = "pdserve"
    # -1: Ray restarts a dead worker every time, as a serving cluster must; N >= 0: at most N times.
    max_restarts: int = -1
    worker_env: dict[str, str] = field(default_factory=dict)  # over DEFAULT_WORKER_ENV, in each worker
    startup_timeout_s: float = 600.0
    actor_resources: dict[str, dict[str, float]] = field(default_factory=dict)  # role -> custom resources
    # Security (docs/security.md): file paths, read when the cluster starts; None = off.
    tls_cert: str | None = None  # the certificate the router and every worker serve
    tls_key: str | None = None
    tls_ca: str | None = None  # trusted when the router and workers dial each other (and clients: mTLS)
    tls_require_client_cert: bool = False  # mutual TLS on every server
    tls_client_cert: str | None = None  # what the router and prefill workers present under mutual TLS
    tls_client_key: str | None = None
    api_token_file: str | None = None  # the router's accepted bearer tokens, one per line
    cluster_secret_file: str | None = None  # the secret of the internal services, one line
    # The router's request limits. NOTE: the defaults mirror router.limits.RequestLimits (a test
    # pins them); importing the router here would pull gRPC into this pure module.
    max_prompt_tokens: int | None = None  # None: the model's context - 1
    max_tokens_limit: int = 4096
    max_message_bytes: int = 4 << 20
    max_concurrent_streams: int = 256
    # none: any request may reuse any other's cached prefix; token: only requests of the same API token
    # (router/service.py CACHE_ISOLATION; docs/security.md weighs the two). token needs api_token_file.
    cache_isolation: str = "none"
    # The remote prefill phase's own deadline: this share of the request's remaining time (so a stalled
    # prefill worker or transfer still leaves the fallback time to answer), at most prefill_timeout_s.
    prefill_deadline_fraction: float = 0.5
    prefill_timeout_s: float = 60.0
    # The background KV audit on every worker (pdserve/worker/scrubber.py): None = off.
    audit_interval_s: float | None = None
    audit_max_fraction: float = DEFAULT_MAX_FRACTION  # of wall time the scrubber may spend auditing

    def __post_init__(self) -> None:
        if self.num_decode < 1:
            raise ValueError(f"decode.count (--decode) must be >= 1, got {self.num_decode}")
        if self.num_prefill < 0:
            raise ValueError(f"prefill.count (--prefill) must be >= 0, got {self.num_prefill}")
        for name, port in (("router.port (--port)", self.port),
                           ("router.metrics_port (--metrics-port)", self.metrics_port)):
            if port is not None and not 0 <= port < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        _check_choice("router.routing (--routing)", self.routing, ROUTING_POLICIES)
        _check_choice("placement (--placement)", self.placement, tuple(PLACEMENTS))
        _check_choice("cache.kv_dtype (--kv-dtype)", self.kv_dtype, KV_DTYPES)
        _check_choice("router.cache_isolation (--cache-isolation)", self.cache_isolation, CACHE_ISOLATION)
        if self.cache_isolation == "token" and self.api_token_file is None:
            raise ValueError("router.cache_isolation (--cache-isolation) token keeps each API token's cache "
                             "apart, so it needs auth.api_token_file (--api-token-file)")
        if not 0 < self.prefill_deadline_fraction < 1 or self.prefill_timeout_s <= 0:
            raise ValueError("router.prefill_deadline_fraction (--prefill-deadline-fraction) must be in "
                             f"(0, 1) and router.prefill_timeout_s (--prefill-timeout-s) > 0, got "
                             f"{self.prefill_deadline_fraction} and {self.prefill_timeout_s}")
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
        for name, value in (("router.max_prompt_tokens (--max-prompt-tokens)", self.max_prompt_tokens),
                            ("router.max_tokens_limit (--max-tokens-limit)", self.max_tokens_limit),
                            ("router.max_message_bytes (--max-message-bytes)", self.max_message_bytes),
                            ("router.max_concurrent_streams (--max-concurrent-streams)",
                             self.max_concurrent_streams)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_restarts < -1:
            raise ValueError(f"max_restarts must be -1 (always restart) or >= 0, got {self.max_restarts}")
        for name, value in self.worker_env.items():
            if not isinstance(name, str) or not isinstance(value, str) or not name or "=" in name:
                raise ValueError(f"worker_env: {name!r}: {value!r} must map a variable name to a string "
                                 "(quote numbers in YAML: MALLOC_ARENA_MAX: \"4\")")
        self._check_tls()
        try:
            check_scrubber_settings(self.audit_interval_s, self.audit_max_fraction)
        except ValueError as exc:
            raise ValueError(f"audit: {exc} (--audit-interval-s, --audit-max-fraction)") from None

    @property
    def worker_environment(self) -> dict[str, str]:
        return {**DEFAULT_WORKER_ENV, **self.worker_env}

    def _check_tls(self) -> None:
        """Which TLS settings go together; whether the files exist is checked when the cluster starts."""
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls.cert (--tls-cert) and tls.key (--tls-key) go together: give both or "
                             "neither")
        if (self.tls_client_cert is None) != (self.tls_client_key is None):
            raise ValueError("tls.client_cert (--tls-client-cert) and tls.client_key (--tls-client-key) go "
                             "together: give both or neither")
        needs_cert = {"tls.ca (--tls-ca)": self.tls_ca is not None,
                      "tls.require_client_cert (--tls-require-client-cert)": self.tls_require_client_cert,
                      "tls.client_cert (--tls-client-cert)": self.tls_client_cert is not None}
        given = [name for name, on in needs_cert.items() if on]
        if self.tls_cert is None and given:
            raise ValueError(f"{', '.join(given)} needs tls.cert and tls.key (--tls-cert, --tls-key): "
                             "the cluster serves TLS only with a certificate")
        if self.tls_require_client_cert and (self.tls_ca is None or self.tls_client_cert is None):
            raise ValueError("tls.require_client_cert (--tls-require-client-cert) needs tls.ca (--tls-ca), "
                             "the CA of the client certificates, and tls.client_cert/tls.client_key "
                             "(--tls-client-cert/--tls-client-key), the certificate the router and prefill "
                             "workers present to the workers (client.pem from `python -m "
                             "pdserve.security.certs`)")

    @property
    def scheduling_strategy(self) -> str:
        return PLACEMENTS[self.placement]


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


# --- the file ----------------------------------------------------------------------------------

_NONE = type(None)
_NUMBER = (int, float)
_PATH = (str, _NONE)
# dotted key in the file -> (ClusterSpec field, accepted types); a section is the part before the dot.
FILE_KEYS: dict[str, tuple[str, tuple[type, ...]]] = {
    "model": ("model_path", (str, _NONE)),
    "host": ("host", (str,)),
    "prefill.count": ("num_prefill", (int,)),
    "prefill.resources": ("actor_resources", (dict,)),
    "decode.count": ("num_decode", (int,)),
    "decode.resources": ("actor_resources", (dict,)),
    "placement": ("placement", (str,)),
    "gpus_per_worker": ("gpus_per_worker", (int, float, _NONE)),
    "cache.block_size": ("block_size", (int,)),
    "cache.kv_dtype": ("kv_dtype", (str,)),
    "cache.kv_cache_gib": ("kv_cache_gib", _NUMBER),
    "cache.num_blocks": ("num_blocks", (int, _NONE)),
    "scheduler.max_batched_tokens": ("max_batched_tokens", (int,)),
    "router.port": ("port", (int,)),
    "router.metrics_port": ("metrics_port", (int, _NONE)),
    "router.routing": ("routing", (str,)),
    "router.min_remote_prefill_tokens": ("min_remote_prefill_tokens", (int,)),
    "router.max_in_flight_per_decode": ("max_in_flight_per_decode", (int,)),
    "router.max_prompt_tokens": ("max_prompt_tokens", (int, _NONE)),
    "router.max_tokens_limit": ("max_tokens_limit", (int,)),
    "router.max_message_bytes": ("max_message_bytes", (int,)),
    "router.max_concurrent_streams": ("max_concurrent_streams", (int,)),
    "router.cache_isolation": ("cache_isolation", (str,)),
    "router.prefill_deadline_fraction": ("prefill_deadline_fraction", _NUMBER),
    "router.prefill_timeout_s": ("prefill_timeout_s", _NUMBER),
    "redis_url": ("redis_url", (str, _NONE)),
    "ray_address": ("ray_address", (str, _NONE)),
    "namespace": ("namespace", (str,)),
    "max_restarts": ("max_restarts", (int,)),
    "worker_env": ("worker_env", (dict,)),
    "tls.cert": ("tls_cert", _PATH),
    "tls.key": ("tls_key", _PATH),
    "tls.ca": ("tls_ca", _PATH),
    "tls.require_client_cert": ("tls_require_client_cert", (bool,)),
    "tls.client_cert": ("tls_client_cert", _PATH),
    "tls.client_key": ("tls_client_key", _PATH),
    "auth.api_token_file": ("api_token_file", _PATH),
    "auth.cluster_secret_file": ("cluster_secret_file", _PATH),
    "audit.interval_s": ("audit_interval_s", (int, float, _NONE)),
    "audit.max_fraction": ("audit_max_fraction", _NUMBER),
}
# Fields that name a file: a relative path in the file is relative to the file.
PATH_FIELDS = ("model_path", "tls_cert", "tls_key", "tls_ca", "tls_client_cert", "tls_client_key",
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
        return ClusterSpec(**fields_)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def with_overrides(spec: ClusterSpec, overrides: Mapping[str, Any]) -> ClusterSpec:
    """spec with the fields given on the command line (None = not given) replaced."""
    return replace(spec, **{name: value for name, value in overrides.items() if value is not None})


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
