"""The router's Redis side: one fast-failing client, the worker registry and the prefix index over it.

    redis_router(config, tokenizer, url, namespace) -> RouterServer whose
        worker directory refreshes from    registry.live_workers, registry.load_of
        placer matches prompts with        index.match (behind the router's circuit breaker)

`pdserve up` (deploy/launcher.py) and the tests build the router with this one function, so a
test of the router against a misbehaving Redis runs exactly what a cluster runs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import redis

from pdserve.engine.tokenizer import Tokenizer
from pdserve.index.redis_index import RedisPrefixIndex
from pdserve.index.registry import WorkerRegistry
from router.server import RouterConfig, RouterServer

# NOTE: the router's own Redis client fails fast: a dead index must cost a request at most one
# short timeout before the circuit breaker routes by load alone.
ROUTER_REDIS_TIMEOUT_S = 0.25


@dataclass(frozen=True)
class RouterRedis:
    """The registry and the prefix index the router reads, over one client."""

    registry: WorkerRegistry
    index: RedisPrefixIndex

    @classmethod
    def connect(cls, url: str, namespace: str, timeout_s: float = ROUTER_REDIS_TIMEOUT_S) -> RouterRedis:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                      retry=None)
        return cls(WorkerRegistry(client, namespace), RedisPrefixIndex(client, namespace))


def redis_router(config: RouterConfig, tokenizer: Tokenizer, redis_url: str, namespace: str,
                 rng: random.Random | None = None) -> RouterServer:
    """A RouterServer (not started) whose workers and prefix index come from the Redis at redis_url."""
    backend = RouterRedis.connect(redis_url, namespace)
    return RouterServer(config, tokenizer, backend.registry.live_workers, match=backend.index.match,
                        load_of=backend.registry.load_of, rng=rng)
