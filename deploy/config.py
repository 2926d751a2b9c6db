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

ROLES = ("prefill", "decode")
# NOTE: mirrors router.placement.POLICIES (a test pins it); importing the router would pull gRPC
# into `pdserve --help` and into this pure module.
ROUTING_POLICIES = ("prefix", "least_load", "round_robin")
# placement -> Ray scheduling_strategy: spread puts actors on different nodes where their
# resources allow; pack lets Ray fill one node first (its default).
PLACEMENTS = {"pack": "DEFAULT", "spread": "SPREAD"}
_RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


@dataclass(frozen=True)
class ClusterSpec:
    model_path: str | None = None
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = 0  # router's Prometheus port; 0 = any free port, None = none
    redis_url: str | None = None
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
    max_restarts: int = 3
    startup_timeout_s: float = 600.0
    actor_resources: dict[str, dict[str, float]] = field(default_factory=dict)  # role -> custom resources

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

    @property
    def scheduling_strategy(self) -> str:
        return PLACEMENTS[self.placement]


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


# --- the file ----------------------------------------------------------------------------------

_NONE = type(None)
_NUMBER = (int, float)
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
    "redis_url": ("redis_url", (str, _NONE)),
    "ray_address": ("ray_address", (str, _NONE)),
    "namespace": ("namespace", (str,)),
}
_SECTIONS = sorted({key.split(".")[0] for key in FILE_KEYS if "." in key})
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", dict: "a mapping", _NONE: "null"}


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
    model = fields_.get("model_path")
    if model is not None and not os.path.isabs(os.path.expanduser(model)):
        # NOTE: relative to the file, not to wherever `pdserve up` runs, so a file travels with its model.
        fields_["model_path"] = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), model))
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
    # NOTE: YAML reads `yes`/`on` as True, and bool is an int in Python; no key here is a flag.
    if isinstance(value, bool) or not isinstance(value, types):
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
