"""RedisPrefixIndex: the prefix index in Redis, written by every worker, read by the router.

apply() is one pipelined round trip; match() is one EVALSHA of MATCH_LUA. The key
layout is in pdserve/index/__init__.py.

How match walks a prompt (KEYS = the block keys of its hashes, in order):

    block 0: SMEMBERS -> members 'w@e'; keep those whose lease `live:w` holds epoch e
    block i: drop each kept member not in block i's set; its depth is i
    stop when nobody is left; whoever survives the last block has depth len(KEYS)

Lease lookups are cached per call, so each worker's lease is read once. While many
workers are still in the running a block costs one SMEMBERS; once few are left, one
SISMEMBER each, so a long prompt matched by one worker does not pay for a large set.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import redis

from pdserve.index.base import Lease, WorkerKey
from pdserve.index.redis_layout import (
    LeaseScripts,
    RedisKeys,
    entry_member,
    parse_entry_member,
    require_bytes_client,
    store_errors,
)

# KEYS: block keys in prompt order. ARGV[1]: lease key prefix.
# Returns a flat list: worker_id, depth, worker_id, depth, ...
MATCH_LUA = """
local live_prefix = ARGV[1]
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

local out = {}
local alive, n = {}, 0
for _, m in ipairs(redis.call("SMEMBERS", KEYS[1])) do
  local wid = current(m)
  if wid then alive[m] = wid; n = n + 1 end
end
local i = 2
while n > 0 and i <= #KEYS do
  local gone = {}
  if n > 2 then
    local present = {}
    for _, m in ipairs(redis.call("SMEMBERS", KEYS[i])) do present[m] = true end
    for m in pairs(alive) do if not present[m] then gone[#gone + 1] = m end end
  else
    for m in pairs(alive) do
      if redis.call("SISMEMBER", KEYS[i], m) == 0 then gone[#gone + 1] = m end
    end
  end
  for _, m in ipairs(gone) do
    out[#out + 1] = alive[m]; out[#out + 1] = i - 1
    alive[m] = nil; n = n - 1
  end
  i = i + 1
end
for _, wid in pairs(alive) do out[#out + 1] = wid; out[#out + 1] = #KEYS end
return out
"""

# KEYS: the entry's hash set, the entries set, the worker's lease.
# ARGV: member 'w@e', epoch, chunk size, block key prefix, "1" to drop even a live entry.
# Pops up to a chunk of hashes and unlinks each from its block set, atomically, so a
# concurrent apply() can never leave a block set naming an entry nobody tracks.
# Returns -1 when the entry is live again (kept), else how many hashes it dropped.
DROP_LUA = """
if ARGV[5] ~= "1" and redis.call("GET", KEYS[3]) == ARGV[2] then return -1 end
local hashes = redis.call("SPOP", KEYS[1], ARGV[3])
for _, h in ipairs(hashes) do redis.call("SREM", ARGV[4] .. h, ARGV[1]) end
if redis.call("SCARD", KEYS[1]) == 0 then redis.call("SREM", KEYS[2], ARGV[1]) end
return #hashes
"""

DROP_CHUNK = 512


class RedisPrefixIndex:
    def __init__(self, client: redis.Redis, namespace: str = "pdserve") -> None:
        require_bytes_client(client)
        self._client = client
        self._keys = RedisKeys(namespace)
        self._leases = LeaseScripts(client, self._keys)
        self._match = client.register_script(MATCH_LUA)
        self._drop = client.register_script(DROP_LUA)

    def apply(self, worker: WorkerKey, stored: Sequence[bytes], removed: Sequence[bytes]) -> None:
        if not stored and not removed:
            return
        k, member = self._keys, entry_member(worker)
        pipe = self._client.pipeline(transaction=False)
        pipe.sadd(k.entries, member)
        for h in stored:
            pipe.sadd(k.block(h), member)
        if stored:
            pipe.sadd(k.entry_hashes(member), *stored)
        for h in removed:
            pipe.srem(k.block(h), member)
        if removed:
            pipe.srem(k.entry_hashes(member), *removed)
        with store_errors(f"apply() for {member}"):
            pipe.execute()

    def replace(self, worker: WorkerKey, hashes: Iterable[bytes]) -> None:
        wanted = set(hashes)
        member = entry_member(worker)
        with store_errors(f"replace() for {member}"):
            held = set(self._client.smembers(self._keys.entry_hashes(member)))
        self.apply(worker, sorted(wanted - held), sorted(held - wanted))

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        if not block_hashes:
            return {}
        keys = [self._keys.block(h) for h in block_hashes]
        with store_errors("match()"):
            flat = self._match(keys=keys, args=[self._keys.live_prefix])
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def worker_hashes(self, worker_id: str) -> set[bytes]:
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
        with store_errors("live_workers()"):
            ids = sorted(m.decode() for m in self._client.smembers(self._keys.workers))
            if not ids:
                return {}
            epochs = self._client.mget([self._keys.live(w) for w in ids])
        return {w: int(e) for w, e in zip(ids, epochs) if e is not None}

    def sweep(self) -> int:
        live = self.live_workers()
        dead = [e for e in self._entries() if live.get(e.worker_id) != e.epoch]
        return sum(self._drop_entry(e, force=False) for e in dead)

    def _entries(self) -> list[WorkerKey]:
        with store_errors("reading the index entries"):
            return [parse_entry_member(m) for m in self._client.smembers(self._keys.entries)]

    def _drop_entry(self, entry: WorkerKey, *, force: bool) -> int:
        member = entry_member(entry)
        k = self._keys
        keys = [k.entry_hashes(member), k.entries, k.live(entry.worker_id)]
        args = [member, entry.epoch, DROP_CHUNK, k.block_prefix, "1" if force else "0"]
        dropped = 0
        with store_errors(f"dropping the entries of {member}"):
            while (n := int(self._drop(keys=keys, args=args))) > 0:
                dropped += n
        return dropped
