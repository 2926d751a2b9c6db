"""The prefix index: which live worker holds which KV blocks, and the worker registry.

Files: base.py (the contract: WorkerKey, Lease, PrefixIndex), memory.py (the pure holder table
and the reference implementation), redis_index.py (the cluster's), redis_layout.py (keys, TTLs,
the lease script and the feed's Lua both Redis users share), feed.py (the change feed as a reader
sees it: pure), mirror.py (the router's in-memory copy, following the feed), registry.py
(WorkerInfo, WorkerRegistry), publisher.py (engine events -> a bounded queue -> apply() on the
publisher's thread), breaker.py (the circuit breaker the router and each worker call Redis
through).

Redis key layout, with ns the namespace ("pdserve") and an *entry* 'worker_id@epoch'
naming one incarnation of a worker. TTL: how long the key lives without being renewed
(redis_layout.py: RETAIN_S, EPOCH_RETAIN_S, and why):

    ns:blk:<16 raw bytes>   SET of entries holding that block hash              TTL RETAIN_S
    ns:wh:<entry>           SET of raw hashes the entry holds (to clean it up)  TTL RETAIN_S
    ns:entries              SET of entries that have index data                 TTL RETAIN_S
    ns:live:<worker_id>     STRING epoch: the lease. Live = this key exists;    TTL the lease's
                            an entry counts only when its epoch equals this value
    ns:epoch:<worker_id>    STRING counter (INCR; seeded from the clock when    TTL EPOCH_RETAIN_S
                            missing, so epochs only grow); leases and writes
                            from an epoch below it are refused
    ns:workers              SET of worker ids holding a lease (the router's     TTL RETAIN_S
                            sweep drops those whose lease is gone)
    ns:info:<worker_id>     HASH of WorkerInfo fields (registry)                TTL the lease's
    ns:load:<worker_id>     HASH of load numbers (registry)                     TTL the lease's
    ns:feed                 STREAM: one entry per change of an entry's hashes   TTL RETAIN_S
                            (seq, entry, stored, removed), MAXLEN ~ FEED_MAXLEN
    ns:feed:seq             STRING counter the feed's entries are numbered by   TTL RETAIN_S
                            (seeded from the clock when missing, like epochs)

Who renews what: the worker's heartbeat (lease, epoch, info, its entry's hash set, workers),
its publisher (every set it writes, and a rolling touch of its block sets). Who deletes: a
restarted worker its older epochs' entries; the router's periodic sweep the entries of
workers whose lease is gone, and their ids in `workers`; expiry whatever nobody deletes.
A malformed key (an info hash or entry member that does not parse) is skipped with a
warning naming it.

apply() and match() are one Lua script call each (redis_index.py says how match walks); the
router does not call RedisPrefixIndex.match but matches on its mirror (mirror.py).
Block hashes stay binary in keys and members: 16 bytes instead of 32 hex characters per
key and per member, and no encoding on the hot path (Python or Lua). Use redis-cli's
--no-raw escaping, or the Python API, to look at them.
"""

from pdserve.index.base import Lease, PrefixIndex, StoreUnavailable, WorkerKey
from pdserve.index.memory import InMemoryPrefixIndex

__all__ = ["InMemoryPrefixIndex", "Lease", "PrefixIndex", "StoreUnavailable", "WorkerKey"]
