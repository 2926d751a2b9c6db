"""The router's Redis side: the worker registry and the prefix index over one fast-failing client, and
the index's mirror over a client of its own.

    redis_router(config, tokenizer, url, namespace) -> RouterServer whose
        worker directory refreshes from    registry.live_workers, registry.load_of
                         and now and then  sweep(): index.sweep() + registry.forget_departed()
        placer matches prompts with        mirror.match (in memory: pdserve/index/mirror.py), the
                                           mirror following the index's feed on its own thread
        companions                         the mirror: started (index read, feed caught up) before
                                           the port opens, stopped after it closes
    (sweeps and matches go through one circuit breaker, the directory's)

Every router replica runs its own mirror over the same feed. The mirror's client waits longer than
the router's (MIRROR_REDIS_TIMEOUT_S): it blocks on the feed, and nothing a request waits for
goes over it.

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
from pdserve.index.mirror import IndexMirror
from pdserve.index.redis_index import RedisPrefixIndex
from pdserve.index.registry import WorkerRegistry
from pdserve.security.redis_auth import redis_exposure_warning
from router.admin import NOT_IN_RAY, RayHome
from router.server import RouterConfig, RouterServer

log = logging.getLogger(__name__)

# NOTE: the router's own Redis client fails fast: a dead index must cost a request at most one
# short timeout before the circuit breaker routes by load alone.
ROUTER_REDIS_TIMEOUT_S = 0.25
# The mirror's client: longer than one XREAD BLOCK (MirrorConfig.block_s), long enough for a snapshot
# of a big index.
MIRROR_REDIS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class RouterRedis:
    """The registry and the prefix index the router reads, over one client, and the index's mirror."""

    registry: WorkerRegistry
    index: RedisPrefixIndex
    mirror: IndexMirror

    @classmethod
    def connect(cls, url: str, namespace: str, timeout_s: float = ROUTER_REDIS_TIMEOUT_S) -> RouterRedis:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                      retry=None)
        mirror_client = redis.Redis.from_url(url, socket_timeout=MIRROR_REDIS_TIMEOUT_S,
                                             socket_connect_timeout=timeout_s, retry=None)
        return cls(WorkerRegistry(client, namespace), RedisPrefixIndex(client, namespace),
                   IndexMirror(mirror_client, namespace))

    def sweep(self) -> int:
        """Delete the index entries of workers whose lease is gone (dead, departed, or an older
        epoch), and their ids from the registry's worker set; returns how many hashes went."""
        forgotten = self.registry.forget_departed()
        swept = self.index.sweep()
        if swept or forgotten:
            log.info("swept %d index entries and %d departed worker ids from Redis", swept, forgotten)
        return swept


def redis_router(config: RouterConfig, tokenizer: Tokenizer, redis_url: str, namespace: str,
                 rng: random.Random | None = None, ray_home: RayHome = NOT_IN_RAY) -> RouterServer:
    """A RouterServer (not started) whose workers and prefix index come from the Redis at redis_url."""
    if (warning := redis_exposure_warning(redis_url)) is not None:
        log.warning("router: %s", warning)
    backend = RouterRedis.connect(redis_url, namespace)
    return RouterServer(config, tokenizer, backend.registry.live_workers, match=backend.mirror.match,
                        load_of=backend.registry.load_of, sweep=backend.sweep, rng=rng,
                        companions=[backend.mirror], ray_home=ray_home)
