"""`pdserve up`: a whole cluster from one command, and its clean teardown.

    start:  read the security files (certificates, API tokens, cluster secret: a bad one fails
            here, before anything starts)
            -> Redis (embedded redis-server on a free loopback port with a generated password,
               unless --redis-url; a plaintext URL beyond loopback is warned about)
            -> Ray (local, or attach with --address) -> prefill and decode actors (each
               requiring its role's Ray custom resources; SPREAD across nodes or packed)
            -> router (Generation on --port; the model's sampling defaults with --default-*
               on top, printed); with --routers N, replicas 1..N-1 as Ray actors on --port + i
               (router/actor.py) -> wait until every worker is live in the registry and every
               server answers health checks
    stop:   routers, actors (graceful, then killed), Ray (if we started it), Redis (if we
            started it); Ctrl-C and SIGTERM both lead here, leaving no process or port.

`pdserve up --detach` (deploy/detached.py) is a LocalCluster whose every process is a detached actor,
router 0 included (lifetime), on a Ray head of its own: the cluster outlives this process.

The router gets the whole SecurityConfig (TLS, API tokens, cluster secret); each worker gets
the TLS file paths and the secret's value in its WorkerSpec and builds its own. A Redis URL
is only ever printed or logged redacted (its password as ***). The run keeps the embedded
Redis's password in LocalCluster.redis_url (handed to each worker in its WorkerSpec, which
leaves it out of repr) and in the server's redis.conf (mode 0600, removed when Redis stops),
whose path it prints for `redis-cli`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import replace

import redis

from deploy.config import ClusterSpec, workers_gpus
from deploy.redis_server import RedisServer, ensure_redis
from pdserve.engine.config import cpu_threads_per_worker
from pdserve.engine.sampling_defaults import SamplingDefaults
from pdserve.engine.weights import LoadedModel, load_model, served_model_name
from pdserve.index.registry import WorkerRegistry
from pdserve.security import SecurityConfig, TLSConfig, read_secret, read_secrets_file
from pdserve.security.redis_auth import check_redis_credentials, redact_redis_url, redis_exposure_warning
from pdserve.status_cli import describe_kernels
from pdserve.worker.actor import WorkerSpec
from protos.pdserve.v1 import worker_pb2
from router.actor import RouterActor, RouterSpec
from router.redis_backend import redis_router
from router.server import RouterConfig, RouterServer

log = logging.getLogger(__name__)


def sampling_defaults_in_force(loaded: LoadedModel, spec: ClusterSpec) -> SamplingDefaults:
    """What the router gives a request's unset temperature/top_p/top_k: the model's, under the
    spec's --default-* / default_* values."""
    return loaded.sampling_defaults.overridden_by(spec.sampling_overrides)


class LocalCluster:
    def __init__(self, spec: ClusterSpec, say=print, lifetime: str | None = None) -> None:
        self.spec = spec
        self.say = say
        self.lifetime = lifetime  # every actor's; "detached" outlives this process (deploy/detached.py)
        self.redis_url = ""
        self.redis_server: RedisServer | None = None
        self.actors: dict[str, object] = {}
        self.router: RouterServer | None = None  # router 0, in this process
        self.replicas: dict[str, object] = {}  # router-1.. (with --routers N): Ray actors
        self.replica_info: dict[str, dict] = {}  # their RouterActor.describe()
        self.registry: WorkerRegistry | None = None
        self.security = SecurityConfig()  # the router's; read from the spec's files in start()
        self._started_ray = False

    # --- start ------------------------------------------------------------------------------
    def start(self) -> str:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> str:
        # NOTE: loaded first, for the router's tokenizer, context length and sampling defaults: a model
        # pdserve cannot run is refused before Redis, Ray or any worker starts. For a GGUF this also
        # converts it once, so N workers on this machine load the cached safetensors in about a
        # second each instead of dequantising in parallel.
        loaded = load_model(self.spec.engine.model_path, progress=False)
        self._start_security()
        self.redis_url, self.redis_server = ensure_redis(self.spec.redis_url)
        self._connect_redis(self.redis_server.config_path if self.redis_server else None)
        self._init_ray()
        sampling = sampling_defaults_in_force(loaded, self.spec)
        self._create_actors()
        model = loaded.config
        config = self._router_config(model.max_position_embeddings, sampling, model.architecture)
        self.router = redis_router(config, loaded.tokenizer, self.redis_url, self.spec.namespace)
        del loaded
        address = self.router.start()
        self._start_replicas(config)
        self.wait_until_live()
        self.say(f"router   {address} (gRPC pdserve.v1.Generation, health, reflection)")
        for name, info in self.replica_info.items():
            http = f" · http {info['http_url']}" if info["http_url"] else ""
            self.say(f"  {name:<9} {info['address']}{http}")
        self.say(f"sampling {self.router.sampling_defaults.describe()} for requests that set none")
        if self.router.metrics_address:
            self.say(f"metrics  http://{self.router.metrics_address}/metrics")
        if self.router.http_url:
            self._say_http()
        return self.addresses

    @property
    def addresses(self) -> str:
        """Every router's gRPC address, comma-separated: what a client's --router takes."""
        return ",".join([self.router.address, *(info["address"] for info in self.replica_info.values())])

    def _say_http(self) -> None:
        url, model = self.router.http_url, self.router.config.served_model_name
        auth = " -H 'Authorization: Bearer $PDSERVE_TOKEN'" if self.security.api_tokens else ""
        question = [{"role": "user", "content": "What is the capital of France?"}]
        body = json.dumps({"model": model, "messages": question, "max_tokens": 32})
        self.say(f"http     {url}/v1 (OpenAI-compatible: chat/completions, completions, models; "
                 "/health, /metrics)")
        self.say(f"  try:   curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
                 f"-d '{body}'")

    def _start_security(self) -> None:
        self.security = self._read_security()
        self.say(f"security {self.security.describe()}")
        for warning in self.security.exposure_warnings(self.spec.host, public=False):
            self.say(f"warning  workers: {warning}")  # the router logs its own

    def _connect_redis(self, embedded_config: str | None) -> None:
        """The registry on self.redis_url: the embedded Redis (embedded_config: its redis.conf, holding the
        password we generated) or the user's (warned about beyond loopback, its credentials checked)."""
        if embedded_config is None:
            if (warning := redis_exposure_warning(self.redis_url)) is not None:
                self.say(f"warning  redis: {warning}")
            check_redis_credentials(self.redis_url)  # a refused password fails here, the URL redacted
        embedded = f" (embedded; generated password in {embedded_config})" if embedded_config else ""
        self.say(f"redis    {redact_redis_url(self.redis_url)}{embedded}")
        client = redis.Redis.from_url(self.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self.registry = WorkerRegistry(client, self.spec.namespace)

    def _read_security(self) -> SecurityConfig:
        """The router's SecurityConfig from the spec's files; ValueError names a bad flag or file."""
        s = self.spec
        tokens = read_secrets_file(s.api_token_file, "API token") if s.api_token_file else ()
        secret = read_secret(file=s.cluster_secret_file, what="cluster secret")
        return SecurityConfig.of_files(s.tls, api_tokens=tokens, cluster_secret=secret)

    def client_security(self) -> SecurityConfig:
        """How a client dials this cluster's router: its CA, the client certificate, the first API token."""
        sec = self.security
        tls = TLSConfig(ca=sec.tls.ca) if sec.tls is not None else None
        return SecurityConfig(tls=tls, client_cert=sec.client_cert, client_key=sec.client_key,
                              api_tokens=sec.api_tokens[:1])

    def _router_config(self, max_context_tokens: int, sampling_defaults: SamplingDefaults,
                       architecture: str | None = None) -> RouterConfig:
        """Router 0's configuration: the model's context, sampling defaults and family."""
        s = self.spec
        return RouterConfig(host=s.host, port=s.port, metrics_port=s.metrics_port, placement=s.placement,
                            http_port=s.http_port or None,
                            served_model_name=s.served_model_name or served_model_name(s.engine.model_path),
                            architecture=architecture,
                            limits=replace(s.limits, max_context_tokens=max_context_tokens),
                            deadlines=s.deadlines, migration=s.migration, cache_isolation=s.cache_isolation,
                            security=self.security, sampling_defaults=sampling_defaults)

    def _start_replicas(self, config: RouterConfig, first: int = 1) -> None:
        """Routers first..N-1 as Ray actors, router i on router 0's ports + i (a free port stays free)."""
        import ray

        for i in range(first, self.spec.num_routers):
            name = f"router-{i}"
            replica = replace(config, port=_offset(config.port, i), http_port=_offset(config.http_port, i),
                              metrics_port=_offset(config.metrics_port, i))
            spec = RouterSpec(name, replica, self.spec.engine.model_path, self.redis_url, self.spec.namespace)
            self.replicas[name] = ray.remote(RouterActor).options(
                name=name, namespace=self.spec.namespace, max_restarts=self.spec.max_restarts,
                lifetime=self.lifetime, max_concurrency=4, num_cpus=0,
                runtime_env={"env_vars": self.spec.worker_environment},
            ).remote(spec)
        for name, actor in self.replicas.items():
            self.replica_info[name] = ray.get(actor.describe.remote(), timeout=self.spec.startup_timeout_s)

    def _init_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return
        total = self.spec.num_prefill + self.spec.num_decode
        kwargs = dict(namespace=self.spec.namespace, include_dashboard=False, log_to_driver=False,
                      logging_level=logging.WARNING)
        if self.spec.ray_address:
            ray.init(address=self.spec.ray_address, **kwargs)
        else:
            ray.init(num_cpus=max(os.cpu_count() or 1, total), object_store_memory=256 << 20, **kwargs)
            self._started_ray = True
        self.say(f"ray      {ray.get_runtime_context().gcs_address}"
                 + (" (local)" if self._started_ray else " (attached)"))

    def _create_actors(self) -> None:
        import ray

        roles = ["prefill"] * self.spec.num_prefill + ["decode"] * self.spec.num_decode
        self._warn_unplaceable(roles)
        gpus = workers_gpus(self.spec.gpus_per_worker, ray.cluster_resources().get("GPU", 0), len(roles))
        threads = None if gpus else self.spec.engine.num_threads or cpu_threads_per_worker(len(roles))
        # NOTE: resolved here as each worker's engine will resolve them, so that a kernel the dtype cannot
        # run (native with bfloat16 on the GPUs) is refused before any actor starts
        dtypes = ", ".join(c.describe() for c in self.spec.engine.resolved("cuda" if gpus else "cpu")[1])
        counts = {"prefill": 0, "decode": 0}
        for role in roles:
            worker_id = f"{role}-{counts[role]}"
            counts[role] += 1
            self.actors[worker_id] = self._actor_class(role).options(
                name=worker_id, namespace=self.spec.namespace, max_restarts=self.spec.max_restarts,
                lifetime=self.lifetime, max_concurrency=16,
                runtime_env={"env_vars": self.spec.worker_environment},
                num_cpus=0 if gpus else 1, num_gpus=gpus,
                resources=self.spec.actor_resources.get(role, {}),
                scheduling_strategy=self.spec.scheduling_strategy,
            ).remote(self._worker_spec(role, worker_id, threads, "cuda" if gpus else "cpu"))
        self.say(f"workers  {self.spec.num_prefill} prefill + {self.spec.num_decode} decode "
                 f"({'1 GPU each, cuda' if gpus else f'CPU, {threads} torch threads each'}; {dtypes}; "
                 f"actor placement {self.spec.actor_placement}{self._resources_note()}); "
                 "loading the model...")
        deadline = self.spec.startup_timeout_s
        for worker_id, actor in self.actors.items():
            self.say(f"  {worker_id:<10} {ray.get(actor.address.remote(), timeout=deadline)}")
        first = worker_pb2.WorkerStatus.FromString(ray.get(next(iter(self.actors.values())).status.remote()))
        self.say(f"kernels  {describe_kernels(first)} (pdserve status: every worker's)")

    def _warn_unplaceable(self, roles: list[str]) -> None:
        """Say so when no node offers a resource a role needs: its actors wait, maybe for an autoscaler."""
        import ray

        offered = ray.cluster_resources()
        for role in dict.fromkeys(roles):
            count = roles.count(role)
            needs = {name: amount * count for name, amount in self.spec.actor_resources.get(role, {}).items()}
            short = {name: offered.get(name, 0.0) for name, amount in needs.items()
                     if offered.get(name, 0.0) < amount}
            if short:
                self.say(f"warning  {count} {role} workers need {needs}; the Ray cluster offers {short}. "
                         f"They wait for nodes that do (an autoscaler may add them), up to "
                         f"{self.spec.startup_timeout_s:.0f} s")

    def _resources_note(self) -> str:
        pinned = [f"{role} needs {needs}" for role, needs in self.spec.actor_resources.items() if needs]
        return f", {'; '.join(pinned)}" if pinned else ""

    @staticmethod
    def _actor_class(role: str):
        import ray

        from decode_worker.actor import DecodeWorker
        from prefill_worker.actor import PrefillWorker

        return ray.remote(PrefillWorker if role == "prefill" else DecodeWorker)

    def _worker_spec(self, role: str, worker_id: str, threads: int | None, device: str = "cpu") -> WorkerSpec:
        """device: cuda for a worker of one GPU (Ray's num_gpus=1 gives it that one), else cpu."""
        s = self.spec
        engine = replace(s.engine, cache=s.engine.cache.for_worker(worker_id), num_threads=threads,
                         device=device)
        return WorkerSpec(role=role, worker_id=worker_id, redis_url=self.redis_url, engine=engine,
                          host=s.host, namespace=s.namespace,
                          tls=s.tls, cluster_secret=self.security.cluster_secret, audit=s.audit,
                          kv_frames=s.kv_frames, decode_hold_after_tokens=s.decode_hold_after_tokens)

    def wait_until_live(self, timeout_s: float = 60.0) -> None:
        """Every worker actor registered in Redis (a restarted one under its new epoch), and the
        router's directory read again."""
        self.wait_until_registered(timeout_s)
        self.router.directory.refresh()

    def wait_until_registered(self, timeout_s: float) -> None:
        """Every worker actor registered in Redis (a restarted one under its new epoch)."""
        deadline = time.monotonic() + timeout_s
        want = set(self.actors)
        while True:
            live = {w.worker_id for w in self.registry.live_workers()}
            if want <= live:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers {sorted(want - live)} did not register in Redis within "
                                   f"{timeout_s:.0f} s; check the Ray logs in /tmp/ray/session_latest/logs")
            time.sleep(0.1)

    # --- stop -------------------------------------------------------------------------------
    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
        self._stop_replicas()
        self._stop_actors()
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False
        if self.redis_server is not None:
            self.redis_server.stop()
            self.redis_server = None

    def _stop_replicas(self) -> None:
        import ray

        for actor in self.replicas.values():
            try:
                ray.get(actor.stop.remote(), timeout=10)
            except Exception as e:  # a dead replica: killed below either way
                log.warning("graceful router stop failed: %s", e)
            ray.kill(actor, no_restart=True)
        self.replicas.clear()
        self.replica_info.clear()

    def _stop_actors(self) -> None:
        if not self.actors:
            return
        import ray

        pending = [actor.stop.remote() for actor in self.actors.values()]
        try:
            ray.get(pending, timeout=15)
        except Exception as e:  # a dead or stuck actor: it is killed below either way
            log.warning("graceful worker stop failed: %s", e)
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        self.actors.clear()


def _offset(port: int | None, i: int) -> int | None:
    """Router i's port: router 0's + i; 0 (any free port) and None (off) stay as they are."""
    return port + i if port else port
