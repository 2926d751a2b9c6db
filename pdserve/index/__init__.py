"""The prefix index: which live worker holds which KV blocks, and the worker registry.

Files: base.py (the contract: WorkerKey, Lease, PrefixIndex), memory.py (pure reference
implementation), redis_index.py (the cluster's), redis_layout.py (keys and the lease
script both Redis users share), registry.py (WorkerInfo, WorkerRegistry), publisher.py
(engine events -> apply()).

Redis key layout, with ns the namespace ("pdserve") and an *entry* 'worker_id@epoch'
naming one incarnation of a worker:

    ns:blk:<16 raw bytes>   SET of entries holding that block hash
    ns:wh:<entry>           SET of raw hashes the entry holds (to clean it up)
    ns:entries              SET of entries that have index data
    ns:live:<worker_id>     STRING epoch, with a TTL: the lease. Live = this key exists;
                            an entry counts only when its epoch equals this value
    ns:epoch:<worker_id>    STRING counter (INCR); never expires, so epochs only grow;
                            leases and writes from an epoch below it are refused
    ns:workers              SET of worker ids that ever took a lease (until removed)
    ns:info:<worker_id>     HASH of WorkerInfo fields (registry)
    ns:load:<worker_id>     HASH of load numbers, expires with the lease (registry)

apply() and match() are one Lua script call each (redis_index.py says how match walks).
Block hashes stay binary in keys and members: 16 bytes instead of 32 hex characters per
key and per member, and no encoding on the hot path (Python or Lua). Use redis-cli's
--no-raw escaping, or the Python API, to look at them.
"""

from pdserve.index.base import Lease, PrefixIndex, StoreUnavailable, WorkerKey
from pdserve.index.memory import InMemoryPrefixIndex

__all__ = ["InMemoryPrefixIndex", "Lease", "PrefixIndex", "StoreUnavailable", "WorkerKey"]
