"""The router's Redis side: one fast-failing client, the worker registry and the prefix index over it.

    redis_router(config, tokenizer, url, namespace) -> RouterServer whose
        worker directory refreshes from    registry.live_workers, registry.load_of
                         and now and then  sweep(): index.sweep() + registry.forget_departed()
        placer matches prompts with        index.match
    (sweeps and matches go through one circuit breaker, the directory's)

`pdserve up` (deploy/launcher.py) and the tests build the router with this one function, so a
test of the router against a misbehaving Redis runs exactly what a cluster runs. Every Redis
error reaches the router as StoreUnavailable (pdserve/index/redis_layout.py: store_errors).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import redis

from pdserve.engine.tokenizer import Tokenizer
from pdserve.index.redis_index import RedisPrefixIndex
from pdserve.index.registry import WorkerRegistry
from pdserve.security.redis_auth import redis_exposure_warning
from router.server import RouterConfig, RouterServer

log = logging.getLogger(__name__)

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

    def sweep(self) -> int:
        """Delete the index entries of workers whose lease is gone (dead, departed, or an older
        epoch), and their ids from the registry's worker set; returns how many hashes went."""
        forgotten = self.registry.forget_departed()
        swept = self.index.sweep()
        if swept or forgotten:
            log.info("swept %d index entries and %d departed worker ids from Redis", swept, forgotten)
        return swept


def redis_router(config: RouterConfig, tokenizer: Tokenizer, redis_url: str, namespace: str,
                 rng: random.Random | None = None) -> RouterServer:
    """A RouterServer (not started) whose workers and prefix index come from the Redis at redis_url."""
    if (warning := redis_exposure_warning(redis_url)) is not None:
        log.warning("router: %s", warning)
    backend = RouterRedis.connect(redis_url, namespace)
    return RouterServer(config, tokenizer, backend.registry.live_workers, match=backend.index.match,
                        load_of=backend.registry.load_of, sweep=backend.sweep, rng=rng)
