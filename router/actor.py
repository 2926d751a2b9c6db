"""A router as a Ray actor: `pdserve up --routers N` runs routers 1..N-1 this way, and
`pdserve up --detach` every router, router 0 too (as detached actors, deploy/detached.py).

In the foreground, router 0 runs in the `pdserve up` process; each replica is its own process,
which Ray places and restarts (max_restarts) on its own ports. Every replica reads the same Redis:
the registry (live workers and their shared load reports, router/shared_load.py) and the prefix
index, through a mirror of its own that follows the workers' block events (pdserve/index/mirror.py).
So any replica places a request as well as any other, and losing one loses only its open streams,
which the clients resume through another (pdserve/client.py).

    __init__: the tokenizer (from the model's files, not its weights) -> redis_router -> start; its Admin
              ClusterStatus names the Ray cluster and namespace it runs in (for `pdserve down --router`)
    stop:     close the ports (graceful), then the actor is killed by the launcher (or `pdserve down`)
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from pdserve.engine.weights import load_tokenizer
from router.admin import RayHome
from router.redis_backend import redis_router
from router.server import RouterConfig


@dataclass(frozen=True)
class RouterSpec:
    """What a replica is given: the same config as router 0's, on its own ports."""

    name: str
    config: RouterConfig
    model_path: str | None
    redis_url: str = field(repr=False)  # holds the embedded Redis's password
    namespace: str = "pdserve"


class RouterActor:
    def __init__(self, spec: RouterSpec) -> None:
        import ray

        logging.basicConfig(level=logging.WARNING)
        self.spec = spec
        tokenizer = load_tokenizer(spec.model_path)
        home = RayHome(ray.get_runtime_context().gcs_address, spec.namespace)
        self.server = redis_router(spec.config, tokenizer, spec.redis_url, spec.namespace, ray_home=home)
        self.server.start()

    def describe(self) -> dict:
        s = self.server
        return {"name": self.spec.name, "address": s.address, "http_url": s.http_url,
                "metrics_address": s.metrics_address, "pid": os.getpid()}

    def stop(self) -> None:
        self.server.stop(grace_s=1.0)
