"""RedisPrefixIndex: the prefix index in Redis, written by every worker, read by the router.

apply() is one EVALSHA of APPLY_LUA; match() is one EVALSHA of MATCH_LUA. The key
layout is in pdserve/index/__init__.py. Both scripts that change entries (APPLY_LUA, DROP_LUA)
also append what they changed to the index's feed (redis_layout.py PUBLISH_FEED_LUA), which the
router's mirror follows (mirror.py); the router matches there, not with MATCH_LUA.

How match walks a prompt h0..h(n-1) in one EVALSHA of MATCH_LUA:

    candidates = SMEMBERS blk:h0, keeping entries 'w@e' whose lease live:w holds e
    for each candidate: SMISMEMBER wh:w@e h1..h15, then the next 60, then the next 240, ...
        (stop at its first missing hash: depth = 1 + hashes present before it)

NOTE: each candidate is checked against its own hash set, not block by block: a Lua
redis.call costs ~4 us on Redis 6.2 however little it does, so 16 workers deep in a
256-block prompt take ~48 calls this way instead of 255 (one per block). Chunks that
grow by 4x keep a shallow match to one call. Side by side in one run (server time,
16 workers x 256 blocks, populated index, a loaded 2-core machine): 1.7 ms this way,
1.9 ms with one SMISMEMBER per block, 3.3 ms with one SISMEMBER per worker and block.
Per-block sets are still kept for every hash: any hash may be the first of a query.

The scripts read keys they build themselves (lease, entry hash sets), which a Redis
Cluster would refuse; the index expects one Redis server (or a primary with replicas).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import redis

from pdserve.engine.hashing import HASH_BYTES, BlockHash
from pdserve.index.base import Lease, WorkerKey
from pdserve.index.redis_layout import (
    PUBLISH_FEED_LUA,
    RETAIN_S,
    LeaseScripts,
    MalformedKeys,
    RedisKeys,
    entry_member,
    milliseconds,
    parse_entry_member,
    require_bytes_client,
    store_errors,
)

# KEYS: the entry's hash set, the entries set, the worker's epoch counter, the feed, the feed's counter.
# ARGV: member 'w@e', epoch, block key prefix, number of stored hashes, RETAIN ms, the stored hashes,
# then the removed hashes. Returns 0 (and writes nothing) when a newer epoch exists; otherwise writes
# the sets and one feed entry (redis_layout.py PUBLISH_FEED_LUA) naming the same hashes.
# NOTE: a script, not a pipeline of SADDs: it is atomic, so a block set and the entry's
# hash set (which match reads) never disagree, and it costs the worker's publisher one
# command to encode instead of one per block (~20 us each in redis-py). Every set it writes
# gets RETAIN_S of life (redis_layout.py says why).
APPLY_LUA = PUBLISH_FEED_LUA + """
if tonumber(ARGV[2]) < tonumber(redis.call("GET", KEYS[3]) or "0") then return 0 end
local member, prefix, retain = ARGV[1], ARGV[3], ARGV[5]
local first_removed = 6 + tonumber(ARGV[4])
local function each_chunk(cmd, key, first, last)
  for i = first, last, 512 do
    redis.call(cmd, key, unpack(ARGV, i, math.min(i + 511, last)))
  end
end
redis.call("SADD", KEYS[2], member)
redis.call("PEXPIRE", KEYS[2], retain)
for i = 6, first_removed - 1 do
  redis.call("SADD", prefix .. ARGV[i], member)
  redis.call("PEXPIRE", prefix .. ARGV[i], retain)
end
each_chunk("SADD", KEYS[1], 6, first_removed - 1)
for i = first_removed, #ARGV do redis.call("SREM", prefix .. ARGV[i], member) end
each_chunk("SREM", KEYS[1], first_removed, #ARGV)
redis.call("PEXPIRE", KEYS[1], retain)
publish_feed(KEYS[4], KEYS[5], retain, "apply", member, table.concat(ARGV, "", 6, first_removed - 1),
             table.concat(ARGV, "", first_removed, #ARGV))
return 1
"""

# KEYS: the entry's hash set, the entries set. ARGV: scan cursor, calls per RETAIN_S / 3, block key
# prefix, RETAIN ms. Renews the life of both sets and of the block sets of the next slice of a scan
# over the entry's hashes, sized so that a full pass takes at most a third of RETAIN_S however many
# blocks the worker holds. Returns the next cursor ("0" when a pass ended).
# NOTE: a rolling slice, not every block at once: 100,000 PEXPIREs in one script would stall every
# other client of Redis for a fraction of a second; a slice costs it about a millisecond.
TOUCH_LUA = """
local held = redis.call("SCARD", KEYS[1])
local count = math.max(256, math.ceil(held / tonumber(ARGV[2])))
local scan = redis.call("SSCAN", KEYS[1], ARGV[1], "COUNT", count)
for _, h in ipairs(scan[2]) do redis.call("PEXPIRE", ARGV[3] .. h, ARGV[4]) end
redis.call("PEXPIRE", KEYS[1], ARGV[4])
redis.call("PEXPIRE", KEYS[2], ARGV[4])
return scan[1]
"""

# KEYS[1]: the block key of the first hash. ARGV[1]: lease key prefix, ARGV[2]: entry hash
# set prefix, ARGV[3..]: the other hashes of the prompt, in order.
# Returns a flat list: worker_id, depth, worker_id, depth, ...
MATCH_LUA = """
local live_prefix, entry_prefix, last = ARGV[1], ARGV[2], #ARGV
local leases = {}
local function current(member)
  local wid, epoch = string.match(member, "^(.+)@(%d+)$")
  if not wid then return nil end
  local held = leases[wid]
  if held == nil then
    held = redis.call("GET", live_prefix .. wid)
    leases[wid] = held
  end
  if held == epoch then return wid end
  return nil
end

local function depth_of(member)
  local depth, pos, chunk = 1, 3, 15
  while pos <= last do
    local stop = math.min(pos + chunk - 1, last)
    local present = redis.call("SMISMEMBER", entry_prefix .. member, unpack(ARGV, pos, stop))
    for _, flag in ipairs(present) do
      if flag == 0 then return depth end
      depth = depth + 1
    end
    pos, chunk = stop + 1, math.min(chunk * 4, 3840)  -- unpack() fails past ~8000 values
  end
  return depth
end

local out = {}
for _, member in ipairs(redis.call("SMEMBERS", KEYS[1])) do
  local wid = current(member)
  if wid then
    out[#out + 1] = wid
    out[#out + 1] = depth_of(member)
  end
end
return out
"""

# KEYS: the entry's hash set, the entries set, the worker's lease, the feed, the feed's counter.
# ARGV: member 'w@e', epoch, chunk size, block key prefix, "1" to drop even a live entry, RETAIN ms.
# Pops up to a chunk of hashes and unlinks each from its block set, atomically, so a
# concurrent apply() can never leave a block set naming an entry nobody tracks; the feed gets
# one "drop" entry naming the hashes popped.
# Returns -1 when the entry is live again (kept), else how many hashes it dropped.
DROP_LUA = PUBLISH_FEED_LUA + """
if ARGV[5] ~= "1" and redis.call("GET", KEYS[3]) == ARGV[2] then return -1 end
local hashes = redis.call("SPOP", KEYS[1], ARGV[3])
for _, h in ipairs(hashes) do redis.call("SREM", ARGV[4] .. h, ARGV[1]) end
if redis.call("SCARD", KEYS[1]) == 0 then redis.call("SREM", KEYS[2], ARGV[1]) end
if #hashes > 0 then publish_feed(KEYS[4], KEYS[5], ARGV[6], "drop", ARGV[1], "", table.concat(hashes)) end
return #hashes
"""

DROP_CHUNK = 512


def check_hash_sizes(*batches: Sequence[BlockHash]) -> None:
    """NOTE: the feed carries hashes concatenated, so each must be HASH_BYTES long to be split again."""
    for batch in batches:
        bad = next((h for h in batch if len(h) != HASH_BYTES), None)
        if bad is not None:
            raise ValueError(f"block hash {bad!r} has {len(bad)} bytes; the index takes hashes of "
                             f"{HASH_BYTES} (pdserve/engine/hashing.py)")


class RedisPrefixIndex:
    def __init__(self, client: redis.Redis, namespace: str = "pdserve") -> None:
        require_bytes_client(client)
        self._client = client
        self._keys = RedisKeys(namespace)
        self._leases = LeaseScripts(client, self._keys)
        self._apply = client.register_script(APPLY_LUA)
        self._match = client.register_script(MATCH_LUA)
        self._drop = client.register_script(DROP_LUA)
        self._touch = client.register_script(TOUCH_LUA)
        self._touch_cursor: dict[WorkerKey, bytes] = {}
        self._malformed = MalformedKeys()

    def apply(self, worker: WorkerKey, stored: Sequence[BlockHash], removed: Sequence[BlockHash]) -> None:
        if not stored and not removed:
            return
        check_hash_sizes(stored, removed)
        k, member = self._keys, entry_member(worker)
        keys = [k.entry_hashes(member), k.entries, k.epoch(worker.worker_id), k.feed, k.feed_seq]
        args = [member, worker.epoch, k.block_prefix, len(stored), milliseconds(RETAIN_S), *stored, *removed]
        with store_errors(f"apply() for {member}"):
            self._apply(keys=keys, args=args)

    def replace(self, worker: WorkerKey, hashes: Iterable[BlockHash]) -> None:
        wanted = set(hashes)
        member = entry_member(worker)
        with store_errors(f"replace() for {member}"):
            held = set(self._client.smembers(self._keys.entry_hashes(member)))
        self.apply(worker, sorted(wanted - held), sorted(held - wanted))

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        if not block_hashes:
            return {}
        k = self._keys
        args = [k.live_prefix, k.entry_hashes(""), *block_hashes[1:]]
        with store_errors("match()"):
            flat = self._match(keys=[k.block(block_hashes[0])], args=args)
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def worker_hashes(self, worker_id: str) -> set[BlockHash]:
        members = [m for m in self._entries() if m.worker_id == worker_id]
        if not members:
            return set()
        keys = [self._keys.entry_hashes(entry_member(m)) for m in members]
        with store_errors(f"worker_hashes({worker_id!r})"):
            return set(self._client.sunion(keys))

    def remove_worker(self, worker_id: str) -> None:
        for entry in self._entries():
            if entry.worker_id == worker_id:
                self._drop_entry(entry, force=True)
        with store_errors(f"remove_worker({worker_id!r})"):
            pipe = self._client.pipeline(transaction=False)
            pipe.delete(self._keys.live(worker_id))
            pipe.srem(self._keys.workers, worker_id)
            pipe.execute()

    def set_live(self, worker: WorkerKey, ttl_s: float) -> Lease:
        return self._leases.set_live(worker, ttl_s)

    def live_workers(self) -> dict[str, int]:
        k = self._keys
        with store_errors("live_workers()"):
            ids = sorted(self._client.smembers(k.workers))
            if not ids:
                return {}
            epochs = self._client.mget([k.live_prefix.encode() + w for w in ids])
        live = {}
        for w, e in zip(ids, epochs):
            if e is None:
                continue
            try:
                live[w.decode()] = int(e)
            except ValueError as bad:  # UnicodeDecodeError is one
                self._malformed.skip(f"{k.live_prefix}{w!r}", bad)
        return live

    def sweep(self) -> int:
        live = self.live_workers()
        dead = [e for e in self._entries() if live.get(e.worker_id) != e.epoch]
        return sum(self._drop_entry(e, force=False) for e in dead)

    def drop_older_epochs(self, worker: WorkerKey) -> int:
        """Delete the entries of worker's earlier incarnations; how many hashes went."""
        older = [e for e in self._entries() if e.worker_id == worker.worker_id and e.epoch < worker.epoch]
        return sum(self._drop_entry(e, force=True) for e in older)

    def touch(self, worker: WorkerKey, every_s: float) -> None:
        """Renew the life of worker's entries: its hash set, and the block sets of the next slice of
        them, sized so that a full pass of calls every every_s seconds takes a third of RETAIN_S."""
        k, member = self._keys, entry_member(worker)
        cursor = self._touch_cursor.get(worker, b"0")
        calls_per_pass = max(1, int(RETAIN_S / 3 / every_s))
        args = [cursor, calls_per_pass, k.block_prefix, milliseconds(RETAIN_S)]
        with store_errors(f"touch() for {member}"):
            self._touch_cursor[worker] = self._touch(keys=[k.entry_hashes(member), k.entries], args=args)

    def _entries(self) -> list[WorkerKey]:
        with store_errors("reading the index entries"):
            members = self._client.smembers(self._keys.entries)
        entries = []
        for m in members:
            try:
                entries.append(parse_entry_member(m))
            except ValueError as bad:  # UnicodeDecodeError is one
                self._malformed.skip(f"{self._keys.entries} member {m!r}", bad)
        return entries

    def _drop_entry(self, entry: WorkerKey, *, force: bool) -> int:
        member = entry_member(entry)
        k = self._keys
        keys = [k.entry_hashes(member), k.entries, k.live(entry.worker_id), k.feed, k.feed_seq]
        args = [member, entry.epoch, DROP_CHUNK, k.block_prefix, "1" if force else "0",
                milliseconds(RETAIN_S)]
        dropped = 0
        with store_errors(f"dropping the entries of {member}"):
            while (n := int(self._drop(keys=keys, args=args))) > 0:
                dropped += n
        return dropped
