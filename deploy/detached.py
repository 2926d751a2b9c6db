"""`pdserve up --detach` and `pdserve down`: a cluster that outlives the command that started it.

In the foreground, `pdserve up` is the Ray driver that owns every actor and runs router 0 itself, so a
SIGKILL of it ends the whole cluster. Detached, nothing the cluster needs belongs to the launcher:

    Ray head   `ray start --head` in a session of its own (unless --address), with token
               authentication: its GCS, raylet and workers are nobody's children. Its temp dir
               (/tmp/pdserve-ray-*) or its GCS address is on the command line of every process it
               starts but Ray's workers, which are its raylet's children: that is how `down` finds
               them all.
    record     detached actor `pdserve-cluster`: what `down` undoes beyond the actors (the head, when
               `up` started one). Made first, so a launcher killed while starting still
               leaves a cluster that `down` can stop.
    redis      detached actor `redis` (RedisActor, unless --redis-url): redis-server is its child, with
               a generated password in a 0600 redis.conf, on the loopback of the launcher's node
    workers    detached actors prefill-0.., decode-0..
    routers    detached actors router-0..router-N-1 (router/actor.py), router i on --port + i

    up --detach:  [ray start --head] -> ray.init(its address) -> record -> redis -> workers -> routers
                  -> every worker registered, and every router's ClusterStatus shows every worker
                  serving -> (the sample chat) -> print the routers and the `pdserve down` command
                  -> exit: the driver ends, nothing detached does. A failure (or Ctrl-C) before that
                  stops what was started, through the same stop() as `down`.
    down:         the Ray address and namespace: from a router's ClusterStatus (--router), or given
                  (--namespace, --address) -> the record, a handle on every named actor -> routers,
                  workers, redis stopped (gracefully, then ray.kill) -> the record killed -> the
                  head `up` started: SIGTERM to its processes, SIGKILL to any left after
                  HEAD_STOP_TIMEOUT_S, its temp dir removed.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil

from deploy.config import ClusterSpec
from deploy.launcher import LocalCluster, sampling_defaults_in_force
from deploy.redis_server import RedisActor, free_port
from pdserve.engine.weights import load_model
from pdserve.security import SecurityConfig
from pdserve.security.redis_auth import RedisAuthFailed
from protos.pdserve.v1 import admin_pb2, admin_pb2_grpc

RECORD_ACTOR = "pdserve-cluster"
REDIS_ACTOR = "redis"
HEAD_TEMP_PREFIX = "pdserve-ray-"
HEAD_START_TIMEOUT_S = 120.0
RAY_AUTH_MODE = "RAY_AUTH_MODE"
RAY_CLI = [sys.executable, "-m", "ray.scripts.scripts"]  # `ray`, whether or not the venv is on PATH
HEAD_STOP_TIMEOUT_S = 3.0  # then SIGKILL: its GCS and raylet take 10 s and more to drain nothing


@dataclass(frozen=True)
class RayHead:
    """A Ray head of the cluster's own: `ray start --head`, every process of it naming temp_dir or address."""

    temp_dir: str
    address: str = ""  # its GCS, host:port

    @classmethod
    def start(cls, num_cpus: int) -> RayHead:
        head = cls(tempfile.mkdtemp(prefix=HEAD_TEMP_PREFIX))
        try:
            # NOTE: in a session of its own: a Ctrl-C or hang-up in the launcher's terminal never reaches it
            run = subprocess.run(head._start_command(num_cpus), capture_output=True, text=True,
                                 timeout=HEAD_START_TIMEOUT_S, env=_head_environment(),
                                 start_new_session=True)
        except subprocess.TimeoutExpired:
            head.stop()
            raise RuntimeError(f"`ray start --head` did not finish within {HEAD_START_TIMEOUT_S:.0f} s; "
                               "give a running Ray with --address instead") from None
        if run.returncode != 0:
            head.stop()
            raise RuntimeError(f"`ray start --head` failed (exit {run.returncode}); give a running Ray with "
                               "--address instead, or read its output:\n"
                               f"{run.stdout[-2000:]}{run.stderr[-2000:]}")
        return cls(head.temp_dir, Path(head.temp_dir, "ray_current_cluster").read_text().strip())

    def _start_command(self, num_cpus: int) -> list[str]:
        # NOTE: free ports for the two services `ray start` would otherwise bind on fixed ones (10001,
        # 52365), so that two heads on one machine do not collide.
        return [*RAY_CLI, "start", "--head", f"--port={free_port()}", f"--temp-dir={self.temp_dir}",
                f"--num-cpus={num_cpus}", f"--object-store-memory={256 << 20}", "--include-dashboard=false",
                "--disable-usage-stats", f"--ray-client-server-port={free_port()}",
                f"--dashboard-agent-listen-port={free_port()}"]

    def processes(self) -> list[psutil.Process]:
        """Every live process of this head: those whose arguments name its temp dir or GCS address (the
        client server names only the latter), and their descendants (Ray's workers, whose process titles
        hide their arguments, and what they started: redis-server)."""
        found: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter(["cmdline"]):
            if any(self._named_in(arg) for arg in proc.info["cmdline"] or ()):
                found[proc.pid] = proc
                try:
                    found.update((child.pid, child) for child in proc.children(recursive=True))
                except psutil.NoSuchProcess:
                    pass
        return [proc for proc in found.values() if _alive(proc)]

    def stop(self) -> None:
        """SIGTERM to every process of the head, SIGKILL to those left after HEAD_STOP_TIMEOUT_S; its
        temp dir (logs, sockets) removed."""
        if not _signal_and_wait(self.processes(), psutil.Process.terminate, HEAD_STOP_TIMEOUT_S):
            _signal_and_wait(self.processes(), psutil.Process.kill, HEAD_STOP_TIMEOUT_S)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _named_in(self, arg: str) -> bool:
        d = self.temp_dir
        in_dir = arg == d or arg.endswith(f"={d}") or (d + os.sep) in arg
        return in_dir or (bool(self.address) and arg.endswith(f"={self.address}"))


def _head_environment() -> dict[str, str]:
    """The head's environment: token authentication unless RAY_AUTH_MODE says otherwise, since its GCS
    listens beyond loopback. The token is Ray's own (~/.ray/auth_token), made here if missing, never
    printed."""
    env = {**os.environ, RAY_AUTH_MODE: os.environ.get(RAY_AUTH_MODE, "token")}
    if env[RAY_AUTH_MODE] == "token":
        subprocess.run([*RAY_CLI, "get-auth-token", "--generate"], capture_output=True, check=True,
                       timeout=60)
    return env


@dataclass(frozen=True)
class ClusterRecord:
    """What `pdserve down` must know beyond the named actors."""

    ray_head: RayHead | None  # the Ray head `up --detach` started; None: it joined a running Ray


class RecordActor:
    def __init__(self, record: ClusterRecord) -> None:
        self._record = record

    def record(self) -> ClusterRecord:
        return self._record


def _alive(proc: psutil.Process) -> bool:
    """Running, and not a zombie (an orphan's zombie waits for an init that may never reap it)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal_and_wait(procs: list[psutil.Process], send, timeout_s: float) -> bool:
    """send(proc) to each of procs; whether every one ended within timeout_s."""
    for proc in procs:
        try:
            send(proc)
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + timeout_s
    while any(_alive(proc) for proc in procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class DetachedCluster(LocalCluster):
    """A LocalCluster whose every process is a detached, named actor (router 0 included), on a Ray head
    of its own unless the spec gives a Ray address."""

    def __init__(self, spec: ClusterSpec, say=print) -> None:
        super().__init__(spec, say, lifetime="detached")
        self.head: RayHead | None = None
        self.record_actor = None
        self.redis_actor = None

    # --- start ------------------------------------------------------------------------------
    def _start(self) -> str:
        self._start_security()
        self._init_ray()
        self._keep_record()
        self._start_redis()
        # NOTE: loaded here for the routers' context length and sampling defaults (and, for a GGUF,
        # converted once for every worker), as in the foreground.
        loaded = load_model(self.spec.engine.model_path, progress=False)
        model, sampling = loaded.config, sampling_defaults_in_force(loaded, self.spec)
        config = self._router_config(model.max_position_embeddings, sampling, model.architecture)
        del loaded
        self._create_actors()
        self._start_replicas(config, first=0)
        self.wait_until_serving(self.spec.startup_timeout_s)
        for name, info in self.replica_info.items():
            http = f" · http {info['http_url']}" if info["http_url"] else ""
            self.say(f"router   {name:<9} {info['address']}{http} (gRPC pdserve.v1.Generation, health)")
        return self.addresses

    @property
    def addresses(self) -> str:
        return ",".join(info["address"] for info in self.replica_info.values())

    def _init_ray(self) -> None:
        import ray

        address = self.spec.ray_address
        if not address:
            total = self.spec.num_prefill + self.spec.num_decode
            self.head = RayHead.start(num_cpus=max(os.cpu_count() or 1, total))
            address = self.head.address
        join_ray(address, self.spec.namespace)
        namespace = self.spec.namespace
        if RECORD_ACTOR in named_actors(namespace):
            raise ValueError(f"a detached cluster already runs in Ray namespace {namespace!r}; stop it with "
                             f"`pdserve down --namespace {namespace} --address {address}`, or give this one "
                             "another --namespace")
        where = f"its own head, logs in {self.head.temp_dir}" if self.head else "attached"
        auth = "token authentication" if os.environ.get(RAY_AUTH_MODE) == "token" else "no authentication"
        self.say(f"ray      {ray.get_runtime_context().gcs_address} ({where}; {auth}), namespace {namespace}")

    def _keep_record(self) -> None:
        import ray

        record = ClusterRecord(self.head)
        self.record_actor = ray.remote(RecordActor).options(
            name=RECORD_ACTOR, namespace=self.spec.namespace, lifetime="detached", num_cpus=0).remote(record)
        ray.get(self.record_actor.record.remote(), timeout=self.spec.startup_timeout_s)

    def _start_redis(self) -> None:
        """The user's Redis (--redis-url), or the embedded one in a detached actor on this node."""
        if self.spec.redis_url is not None:
            self.redis_url = self.spec.redis_url
            self._connect_redis(None)
            return
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # NOTE: on this node, as in the foreground: the server binds its loopback.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.redis_actor = ray.remote(RedisActor).options(
            name=REDIS_ACTOR, namespace=self.spec.namespace, lifetime="detached", num_cpus=0,
            scheduling_strategy=here).remote()
        timeout = self.spec.startup_timeout_s
        self.redis_url = ray.get(self.redis_actor.url.remote(), timeout=timeout)
        self._connect_redis(ray.get(self.redis_actor.config_path.remote(), timeout=timeout))

    def wait_until_serving(self, timeout_s: float) -> None:
        """Every worker registered in Redis, and every router's ClusterStatus showing each one serving."""
        deadline = time.monotonic() + timeout_s
        self.wait_until_registered(timeout_s)
        for name, info in self.replica_info.items():
            address = info["address"]
            while not self._router_sees_every_worker(address):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} at {address} does not show every worker serving within "
                                       f"{timeout_s:.0f} s; `pdserve status --router {address}` shows "
                                       "what it sees")
                time.sleep(0.1)

    def _router_sees_every_worker(self, address: str) -> bool:
        reply = cluster_status(address, self.client_security(), timeout_s=5.0)
        serving = {w.status.worker_id for w in reply.workers if w.state == "serving"} if reply else set()
        return set(self.actors) <= serving

    # --- stop -------------------------------------------------------------------------------
    def release(self) -> None:
        """This process leaves the cluster (its Ray driver ends); the cluster runs on."""
        import ray

        ray.shutdown()

    def stop(self) -> None:
        """Routers, workers, Redis, the record, then the Ray head if `up` started it."""
        import ray

        super().stop()
        if self.redis_actor is not None:
            _stop_actor(self.redis_actor)
            self.redis_actor = None
        if self.record_actor is not None:
            ray.kill(self.record_actor, no_restart=True)
            self.record_actor = None
        if ray.is_initialized():
            ray.shutdown()
        if self.head is not None:
            self.head.stop()
            self.head = None

    @classmethod
    def find(cls, address: str, namespace: str, say=print) -> DetachedCluster:
        """The detached cluster in namespace on the Ray cluster at address, with a handle on every actor."""
        import ray

        join_ray(address, namespace)
        names = named_actors(namespace)
        if RECORD_ACTOR not in names:
            ray.shutdown()
            raise ValueError(f"no detached pdserve cluster in Ray namespace {namespace!r} at {address} "
                             f"(named actors there: {sorted(names) or 'none'}); a cluster started by "
                             "`pdserve up` without --detach stops with Ctrl-C where it runs")
        cluster = cls(ClusterSpec(namespace=namespace), say)
        cluster.record_actor = ray.get_actor(RECORD_ACTOR)
        record = ray.get(cluster.record_actor.record.remote(), timeout=30)
        cluster.head = record.ray_head
        for name in names:
            handle = ray.get_actor(name)
            if name.startswith("router-"):
                cluster.replicas[name] = handle
            elif name.startswith(("prefill-", "decode-")):
                cluster.actors[name] = handle
            elif name == REDIS_ACTOR:
                cluster.redis_actor = handle
        return cluster


def _stop_actor(actor) -> None:
    import ray

    try:
        ray.get(actor.stop.remote(), timeout=10)
    except Exception as e:  # noqa: BLE001 - a dead or stuck actor: it is killed below either way
        logging.getLogger(__name__).warning("graceful stop failed: %s", e)
    ray.kill(actor, no_restart=True)


def join_ray(address: str, namespace: str) -> None:
    """This process as a driver of the Ray cluster at address.

    NOTE: `ray start` turns token authentication on whenever a token exists (and RAY_AUTH_MODE is unset),
    but ray.init given an address never does. So this driver applies `ray start`'s rule to itself, with
    Ray's own function (it also reloads Ray's config, which is read once, at import): it sends the token
    whenever there is one, which a head without authentication ignores.
    """
    import ray
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )

    ray_says = logging.getLogger(maybe_enable_token_auth_if_token_available.__module__)
    level = ray_says.level
    ray_says.setLevel(logging.ERROR)  # its warning that it enabled tokens: the `ray` line says so
    try:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        ray_says.setLevel(level)
    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.WARNING)


def named_actors(namespace: str) -> set[str]:
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace}


def cluster_status(router: str, security: SecurityConfig,
                   timeout_s: float) -> admin_pb2.ClusterStatusReply | None:
    """The router's ClusterStatus; None when it does not answer."""
    with security.open_channel(router, internal=False) as channel:
        try:
            return admin_pb2_grpc.AdminStub(channel).ClusterStatus(admin_pb2.ClusterStatusRequest(),
                                                                  timeout=timeout_s)
        except grpc.RpcError:
            return None


# --- the commands ---------------------------------------------------------------------------------

def run_up_detached(args: argparse.Namespace) -> int:
    from deploy.up import answer_sample, client_flags, spec_from_args

    cluster = DetachedCluster(spec_from_args(args))
    if args.config:
        print(f"config   {args.config}", flush=True)
    try:
        address = cluster.start()  # on a failure, it stops what it started
    except RedisAuthFailed as exc:  # a user error, like a bad flag: no traceback
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("stopped.", file=sys.stderr, flush=True)
        return 130
    try:
        if not args.no_sample:
            answer_sample(address, cluster.client_security())
    except BaseException:
        cluster.stop()
        raise
    flags = client_flags(cluster.spec, len(cluster.security.api_tokens))
    first = address.split(",")[0]
    print(f"serving on {address}; try:  pdserve generate --router {address}{flags} \"Hello\"\n"
          f"detached: the cluster runs on after this command ends. Stop it with:\n"
          f"  pdserve down --router {first}{flags}\n"
          f"  (or: pdserve down --namespace {cluster.spec.namespace} --address "
          f"{_gcs_address()})", flush=True)
    cluster.release()
    return 0


def _gcs_address() -> str:
    import ray

    return ray.get_runtime_context().gcs_address


def run_down(args: argparse.Namespace) -> int:
    from pdserve.client_security import security_from_args

    if args.router:
        if args.address:
            raise ValueError("--address goes with --namespace; with --router, the router names its Ray "
                             "cluster")
        address, namespace = ray_home_of(args.router, security_from_args(args))
    else:
        if not args.address:
            raise ValueError("--namespace needs --address: the Ray address `pdserve up --detach` printed "
                             "(or `auto` for the Ray cluster this machine joined)")
        address, namespace = args.address, args.namespace
    cluster = DetachedCluster.find(address, namespace)
    actors = [*cluster.replicas, *cluster.actors, *([REDIS_ACTOR] if cluster.redis_actor else [])]
    head = f" and the Ray head at {address}" if cluster.head else ""
    print(f"stopping namespace {namespace}: {', '.join(actors) or 'no actors'}{head} ...", flush=True)
    cluster.stop()
    print("stopped.", flush=True)
    return 0


def ray_home_of(router: str, security: SecurityConfig) -> tuple[str, str]:
    """The Ray address and namespace the router at `router` runs in (its ClusterStatus)."""
    reply = cluster_status(router, security, timeout_s=10.0)
    if reply is None:
        raise ValueError(f"the router at {router} does not answer; give the cluster as --namespace NAME "
                         "--address HOST:PORT (`pdserve up --detach` printed both)")
    if not reply.ray_address:
        raise ValueError(f"the router at {router} runs in a `pdserve up` process, not as a detached actor: "
                         "stop that one with Ctrl-C (or SIGTERM) where it runs")
    return reply.ray_address, reply.ray_namespace
