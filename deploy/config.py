"""A cluster's topology: the frozen ClusterSpec, and the YAML file that gives it (`pdserve up --config`).

    FILE --yaml.safe_load--> nested mapping --each key found among the settings, its type checked-->
         field paths and values --flags given on the command line replace theirs--> ClusterSpec
         (each part checks its values)

One configuration tree, each setting declared once: ClusterSpec composes the EngineConfig (the model,
its CacheConfig and SchedulerConfig, kernels and threads: pdserve/engine/config.py), the router's
PlacementConfig, RequestDeadlines, MigrationPolicy (router/config.py) and RequestLimits
(router/limits.py), the KVFrames of a transfer (pdserve/transfer/frames.py), the TLS files
(pdserve/security/files.py), the audit schedule (pdserve/worker/scrubber.py) and the
SamplingOverrides over the model's sampling defaults (pdserve/engine/sampling_defaults.py). Each
field a user sets carries its file key, flag, help and choices (`setting(...)`, pdserve/settings.py);
the file reader below and `pdserve up`'s flags (deploy/cli.py) are built from them, so adding a
setting is adding a field. A part that refuses a value raises a FieldError, which is re-worded
with the key and the flag the user wrote: `cache.kv_dtype (--kv-dtype) must be one of float32,
float16, bfloat16, int8, fp8, got 'int4'`.

Pure: yaml, dataclasses and those pure config modules only, no Ray, Redis or gRPC, so a bad file
fails in milliseconds, before anything starts. Errors name the file and the key: `local.yaml:
unknown key 'prefil' (did you mean 'prefill'?)`. `pdserve up --help` lists every flag with its file
key; deploy/examples/*.yaml show the file with comments, docs/deploy.md explains it.
"""

from __future__ import annotations

import difflib
import functools
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.hashing import CACHE_ISOLATION
from pdserve.engine.named_models import MODELS
from pdserve.engine.sampling_defaults import SamplingOverrides
from pdserve.field_error import FieldError
from pdserve.security.files import TLSFiles
from pdserve.settings import Leaf, compose, not_a_setting, setting, settings
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
_A_MAPPING = "a mapping: a flag has no syntax for one"


@dataclass(frozen=True)
class ClusterSpec:
    """The cluster: its workers, routers, Redis and Ray, and what they serve with."""

    engine: EngineConfig = field(default_factory=EngineConfig)  # every worker's engine
    host: str = setting("127.0.0.1", flag="--host", key="host",
                        help="address the router and workers bind and the workers advertise (default: "
                             "127.0.0.1, loopback only)")
    num_prefill: int = setting(1, flag="--prefill", key="prefill.count", metavar="N",
                               help="number of prefill workers; 0 = every prompt is prefilled on a decode "
                                    "worker")
    prefill_resources: dict[str, float] = setting(
        default_factory=dict, key="prefill.resources", file_only=_A_MAPPING,
        help="Ray custom resources each prefill actor requires, e.g. {prefill: 1}")
    kv_frames: KVFrames = field(default_factory=KVFrames)  # how prefill workers cut KV transfers
    num_decode: int = setting(1, flag="--decode", key="decode.count", metavar="M",
                              help="number of decode workers, at least 1")
    decode_resources: dict[str, float] = setting(
        default_factory=dict, key="decode.resources", file_only=_A_MAPPING,
        help="Ray custom resources each decode actor requires, e.g. {decode: 1}")
    actor_placement: str = setting(
        "pack", flag="--actor-placement", key="actor_placement", choices=tuple(ACTOR_PLACEMENTS),
        renamed_from=("placement", "--placement"),
        help="how Ray places the worker actors: spread = on different Ray nodes where their resources "
             "allow; pack = Ray's default, filling a node first")
    # NOTE: one worker = one GPU: its engine runs on one device. None decides at start
    # (workers_gpus): 1 when the Ray cluster has GPUs, 0 (CPU) when it has none. An autoscaling
    # cluster has no GPU node yet at start, so its config says 1 explicitly.
    gpus_per_worker: float | None = setting(
        None, flag="--gpus-per-worker", key="gpus_per_worker", metavar="N",
        help="GPUs each worker actor asks Ray for: 1 = one GPU each, its engine on cuda; 0 = run on CPU "
             "(default: 1 when the Ray cluster has a GPU for every worker at start, 0 when it has none)")
    # Router replicas over the same Redis index and registry; router i serves on port + i (and
    # http_port + i, metrics_port + i where those are set): router 0 in the launcher, the others as
    # Ray actors (router/actor.py).
    num_routers: int = setting(
        1, flag="--routers", key="router.count", metavar="N",
        help="router replicas over the same prefix index and worker registry, router i on router.port + i "
             "(and http_port + i, metrics_port + i when set); router 0 runs in the `pdserve up` process, the "
             "others as Ray actors. Clients take every address: --router a:1,b:2")
    port: int = setting(50051, flag="--port", key="router.port",
                        help="port of the router's gRPC endpoint; 0 = any free port")
    metrics_port: int | None = setting(0, flag="--metrics-port", key="router.metrics_port", metavar="PORT",
                                       help="port of the router's Prometheus /metrics; 0 = any free port; "
                                            "none = no endpoint")
    http_port: int = setting(8000, flag="--http-port", key="router.http_port", metavar="PORT",
                             help="port of the router's OpenAI-compatible HTTP API (/v1/chat/completions, "
                                  "/v1/completions, /v1/models, /health, /metrics); 0 = off")
    served_model_name: str | None = setting(
        None, flag="--served-model-name", key="router.served_model_name", metavar="NAME",
        help="the model name HTTP requests give in `model` (default: the model's own, SmolLM2-135M-Instruct "
             "for the embedded one, else the folder or file name)")
    placement: PlacementConfig = field(default_factory=PlacementConfig)  # the router's request placement
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may ask of the router
    # none: any request may reuse any other's cached prefix; token: only requests of the same API token
    # (router/server.py RouterConfig.cache_isolation; docs/security.md weighs the two).
    cache_isolation: str = setting(
        "none", flag="--cache-isolation", key="router.cache_isolation", choices=CACHE_ISOLATION,
        help="none: any request may reuse any other's cached prefix (more hits); token: only requests made "
             "with the same API token share cached blocks, so one tenant cannot tell from cached_tokens what "
             "another asked (needs auth.api_token_file)")
    deadlines: RequestDeadlines = field(default_factory=RequestDeadlines)  # the router's request deadlines
    migration: MigrationPolicy = field(default_factory=MigrationPolicy)  # streams whose decode worker breaks
    redis_url: str | None = setting(  # may hold a password: not in repr()
        None, flag="--redis-url", key="redis_url", metavar="URL", repr=False,
        help="Redis for the registry and prefix index, e.g. redis://:PASSWORD@host:6379/0 (default: start an "
             "embedded redis-server on a free loopback port, with a generated password)")
    ray_address: str | None = setting(
        None, flag="--address", key="ray_address", metavar="RAY_ADDRESS",
        help="Ray cluster to join, e.g. host:6379, or auto for the one running on this node (default: start "
             "a local Ray)")
    namespace: str = setting("pdserve", flag="--namespace", key="namespace",
                             help="Ray namespace and Redis key prefix")
    max_restarts: int = setting(
        -1, flag="--max-restarts", key="max_restarts", metavar="N",
        help="times Ray restarts a worker (or router replica) whose process died: -1 = every time, as a "
             "serving cluster must; N >= 0 = at most N times")
    worker_env: dict[str, str] = setting(
        default_factory=dict, key="worker_env", file_only=_A_MAPPING,
        help="environment variables set in every worker process, over DEFAULT_WORKER_ENV; values are strings")
    startup_timeout_s: float = not_a_setting(600.0, why="how long `pdserve up` waits for a worker or router "
                                                        "actor to start; tests shorten it")
    # Security (docs/security.md): file paths, read when the cluster starts; None = off.
    tls: TLSFiles = field(default_factory=TLSFiles)  # what the router and every worker serve and trust
    api_token_file: str | None = setting(
        None, flag="--api-token-file", key="auth.api_token_file", is_path=True, metavar="FILE",
        help="require a bearer token on the router's Generation and Admin APIs: the accepted tokens, one "
             "per line (# comments skipped)")
    cluster_secret_file: str | None = setting(
        None, flag="--cluster-secret-file", key="auth.cluster_secret_file", is_path=True, metavar="FILE",
        help="require this secret (one line) on the workers' Worker and KVTransfer services; the router and "
             "workers send it to each other")
    audit: AuditSchedule = field(default_factory=AuditSchedule)  # the background KV audit on every worker
    # Over the model's sampling defaults (its generation_config.json, or SmolLM2's model card): what
    # the router gives a request that leaves temperature, top_p or top_k unset. None keeps the model's.
    sampling_overrides: SamplingOverrides = field(default_factory=SamplingOverrides)
    # Every decode worker holds each stream once it has sent this many tokens, until its actor's
    # release_hold() (decode_worker/faults.py).
    decode_hold_after_tokens: int | None = not_a_setting(None, why="debug only: the fault suite sets it")

    def __post_init__(self) -> None:
        self._check_parts()
        if self.num_decode < 1:
            raise FieldError("num_decode", "must be >= 1", self.num_decode)
        if self.num_prefill < 0:
            raise FieldError("num_prefill", "must be >= 0", self.num_prefill)
        if self.num_routers < 1:
            raise FieldError("num_routers", "must be >= 1", self.num_routers)
        for name in ("port", "metrics_port", "http_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port < 65536:
                raise FieldError(name, "must be in [0, 65535]", port)
        _check_choice("actor_placement", self.actor_placement, tuple(ACTOR_PLACEMENTS))
        _check_choice("cache_isolation", self.cache_isolation, CACHE_ISOLATION)
        if self.cache_isolation == "token" and self.api_token_file is None:
            raise ValueError(f"{field_label('cache_isolation')} token keeps each API token's cache apart, so "
                             f"it needs {field_label('api_token_file')}")
        if self.gpus_per_worker is not None and self.gpus_per_worker not in (0, 1):
            raise FieldError("gpus_per_worker", "must be 0 (CPU) or 1: one worker = one GPU, its engine on "
                             "one device (run more workers for more GPUs)", self.gpus_per_worker)
        for role in ("prefill", "decode"):
            _check_resources(role, getattr(self, f"{role}_resources"))
        if self.max_restarts < -1:
            raise FieldError("max_restarts", "must be -1 (always restart) or >= 0", self.max_restarts)
        for name, value in self.worker_env.items():
            if not isinstance(name, str) or not isinstance(value, str) or not name or "=" in name:
                raise ValueError(f"worker_env: {name!r}: {value!r} must map a variable name to a string "
                                 "(quote numbers in YAML: MALLOC_ARENA_MAX: \"4\")")
        self._check_tls()

    def _check_parts(self) -> None:
        """Each part is its own config dataclass (it checks its values); refuse anything else, such as
        a value meant for a field of the part."""
        for name, part in _part_types().items():
            if not isinstance(getattr(self, name), part):
                raise TypeError(f"ClusterSpec.{name} must be a {part.__name__}, got {getattr(self, name)!r}")

    @property
    def actor_resources(self) -> dict[str, dict[str, float]]:
        """role -> the Ray custom resources each of its actors requires, for the roles that require any."""
        by_role = {"prefill": self.prefill_resources, "decode": self.decode_resources}
        return {role: resources for role, resources in by_role.items() if resources}

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


def workers_gpus(requested: float | None, cluster_gpus: float, workers: int) -> int:
    """Each worker's GPUs (0 or 1): gpus_per_worker where set; else 1 where the Ray cluster
    (ray.cluster_resources()["GPU"]) has a GPU for every worker, 0 where it has none. A cluster with
    GPUs for some workers only is refused: its workers would wait for GPUs that never come, or run
    on CPUs beside idle GPUs."""
    if requested is not None:
        return int(requested)
    if cluster_gpus <= 0:
        return 0
    if cluster_gpus < workers:
        raise ValueError(f"the Ray cluster has {cluster_gpus:g} GPUs for {workers} workers, and each worker "
                         "takes one GPU: run at most that many workers (prefill.count + decode.count), or "
                         "set gpus_per_worker (--gpus-per-worker) 0 to run them on CPUs, or 1 to wait for "
                         "GPU nodes (an autoscaler)")
    return 1


@functools.cache
def _part_types() -> dict[str, type]:
    hints = typing.get_type_hints(ClusterSpec)
    return {f.name: hints[f.name] for f in fields(ClusterSpec) if is_dataclass(hints[f.name])}


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise FieldError(name, f"must be one of {', '.join(choices)}", value)


def _check_resources(role: str, resources: dict[str, float]) -> None:
    for name, amount in resources.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise ValueError(f"'{role}.resources.{name}' must be a number (units of the Ray resource), "
                             f"got {amount!r}")
        if name in _RAY_BUILTIN_RESOURCES:
            raise ValueError(f"{role}.resources.{name}: Ray takes {name} as an argument of its own, "
                             "not a custom resource; use gpus_per_worker for GPUs")
        if amount < 0:
            raise ValueError(f"{role}.resources.{name} must be >= 0, got {float(amount)}")


# --- the settings, by file key, flag and field path -------------------------------------------------

@functools.cache
def _settings() -> tuple[Leaf, ...]:
    return tuple(settings(ClusterSpec))


@functools.cache
def _by_key() -> dict[str, Leaf]:
    return {leaf.setting.key: leaf for leaf in _settings() if leaf.setting.key}


@functools.cache
def _by_path() -> dict[str, Leaf]:
    return {leaf.path: leaf for leaf in _settings()}


def flag_settings() -> tuple[Leaf, ...]:
    """The settings `pdserve up` takes as flags, in field order (deploy/cli.py builds them)."""
    return tuple(leaf for leaf in _settings() if leaf.setting.flag)


def field_label(path: str) -> str:
    """How a user names a field: its file key and flag, 'cache.kv_dtype (--kv-dtype)'."""
    leaf = _by_path().get(path)
    return leaf.label if leaf is not None else path


def _renamed_keys() -> dict[str, Leaf]:
    return {leaf.setting.renamed_from[0]: leaf for leaf in _settings() if leaf.setting.renamed_from}


# --- the file ---------------------------------------------------------------------------------------

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", dict: "a mapping",
               type(None): "null", bool: "true or false"}


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
    values: dict[str, Any] = {}
    for key, value in _flatten(document, path).items():
        leaf = _by_key()[key]
        _check_type(path, key, value, leaf.accepted_types())
        if leaf.setting.is_path and value is not None and not os.path.isabs(os.path.expanduser(value)):
            # NOTE: relative to the file, not to wherever `pdserve up` runs, so a file travels with its
            # model and certificates; a model's name (gemma3-270m) stays a name unless a file or folder
            # of that name sits beside the file (pdserve/engine/named_models.py).
            beside = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), value))
            if not (leaf.path == "engine.model_path" and value in MODELS and not os.path.exists(beside)):
                value = beside
        values[leaf.path] = value
    try:
        return with_overrides(ClusterSpec(), values)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def with_overrides(spec: ClusterSpec, overrides: Mapping[str, Any]) -> ClusterSpec:
    """spec with the values at the given field paths replaced; a value a part refuses is named by the
    key and flag that set it."""
    return compose(spec, overrides, field_label)


def _flatten(document: Any, path: str) -> dict[str, Any]:
    if not isinstance(document, dict):
        raise ValueError(f"{path}: expected a mapping of keys ({', '.join(_top_keys())}), "
                         f"got {type(document).__name__}")
    out: dict[str, Any] = {}
    sections = _sections()
    for key, value in document.items():
        key = str(key)
        if key in sections:
            section = value if value is not None else {}
            if not isinstance(section, dict):
                raise ValueError(f"{path}: '{key}' must be a mapping of "
                                 f"{', '.join(_section_keys(key))}, got {section!r}")
            for sub, sub_value in section.items():
                dotted = f"{key}.{sub}"
                if dotted not in _by_key():
                    _unknown(path, dotted, [f"{key}.{k}" for k in _section_keys(key)])
                out[dotted] = sub_value
        elif key in _by_key():
            out[key] = value
        elif key in _renamed_keys():
            s = _renamed_keys()[key].setting
            raise ValueError(f"{path}: '{key}' is now '{s.key}' ({' or '.join(s.choices)}: {s.summary}); "
                             "rename it in the file")
        else:
            _unknown(path, key, _top_keys())
    return out


def _sections() -> set[str]:
    return {key.split(".")[0] for key in _by_key() if "." in key}


def _top_keys() -> list[str]:
    return list(dict.fromkeys(key.split(".")[0] for key in _by_key()))


def _section_keys(section: str) -> list[str]:
    return [key.split(".", 1)[1] for key in _by_key() if key.startswith(section + ".")]


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


# --- the flags --------------------------------------------------------------------------------------

def flag_values(args: object) -> dict[str, Any]:
    """field path -> value of every setting flag given on the command line (deploy/cli.py names each
    flag's argparse dest after its field path and leaves it out when not given)."""
    return {leaf.path: getattr(args, leaf.path) for leaf in flag_settings() if hasattr(args, leaf.path)}


def as_flags(spec: ClusterSpec) -> list[str]:
    """The `pdserve up` arguments that give spec: a flag for each flag setting that differs from the
    default; a file-only setting has none, so it must be at its default."""
    default, argv = ClusterSpec(), []
    for leaf in _settings():
        value, was = _get(spec, leaf.path), _get(default, leaf.path)
        if value == was:
            continue
        if not leaf.setting.flag:
            raise ValueError(f"{leaf.label} is set only in a file ({leaf.setting.file_only})")
        if isinstance(value, bool):
            if not value:
                raise ValueError(f"{leaf.setting.flag} turns {leaf.label} on; nothing turns it off")
            argv.append(leaf.setting.flag)
        else:
            argv += [leaf.setting.flag, "none" if value is None else str(value)]
    return argv


def _get(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj
