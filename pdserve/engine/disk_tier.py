"""The disk tier: blocks leaving the host tier are written to files, and survive a restart.

    host tier ──(LRU out: write)──▶ DIR/<hash>.kvb ──(LRU out, over the bound)──▶ deleted
        device pool ◀──(restore: read, check, copy; the file is deleted)──┘

One file per block:

    | b"PDKV" | u32 header length | msgpack header | the block's KV bytes |
    header: version, layout (fingerprint of what the bytes mean: engine salt = model, tokenizer,
            block size, dtype; and the block's shape), hash, parent hash, token ids, nbytes,
            checksum (xxh3-64 of the KV bytes)

Writes are atomic: the file is written as DIR/.tmp-<hash>-<pid> and renamed into place, so a
crash mid-write leaves a temp file, never a half-readable block. At start the tier scans DIR:
temp files are deleted unread; a file whose header does not parse, names another layout, or
whose bytes fail the checksum is deleted, never loaded; the rest are this worker's blocks again
(oldest first by mtime), which its next index resync publishes under its new epoch: a restarted
worker comes back warm. A restore checks the file again (the disk may have changed since).

Bounded: at most max_blocks files, evicted LRU (BlockRemoved(DISK)). The tiers are exclusive: a
restored block's file is deleted, as its KV is on the device again.
One owner: the host tier calls every method, under the engine's lock.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from collections import OrderedDict
from pathlib import Path

import msgpack
import torch
import xxhash

from pdserve.engine.block_pool import SpilledBlock, TierUsage
from pdserve.engine.events import BlockRemoved, BlockStored, KVEvent, Tier, index_key
from pdserve.engine.hashing import BlockHash

log = logging.getLogger(__name__)

MAGIC = b"PDKV"
VERSION = 1
SUFFIX = ".kvb"
TEMP_PREFIX = ".tmp-"


def layout_fingerprint(kv_cache: torch.Tensor, salt: bytes) -> str:
    """What a block's bytes mean: the engine salt (model, tokenizer, block size, KV dtype) and the
    shape and storage type of one block."""
    layers, two, _, bs, heads, row = kv_cache.shape
    text = f"{salt.hex()}|{layers}x{two}x{bs}x{heads}x{row}|{kv_cache.dtype}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class DiskTier:
    def __init__(self, directory: str, max_blocks: int, kv_cache: torch.Tensor, salt: bytes) -> None:
        if max_blocks < 1:
            raise ValueError(f"disk tier max_blocks must be >= 1, got {max_blocks}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_blocks = max_blocks
        self.layout = layout_fingerprint(kv_cache, salt)
        self._block_shape = tuple(kv_cache.shape[:2]) + tuple(kv_cache.shape[3:])
        self._dtype = kv_cache.dtype
        self._lru: OrderedDict[BlockHash, SpilledBlock] = OrderedDict()
        self.skipped = 0  # files deleted at the scan or a restore: temp, corrupt or another layout
        self._scan()

    # --- what the host tier calls ---------------------------------------------------------------
    def holds(self, block_hash: BlockHash) -> bool:
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return True
        return False

    def write(self, block: SpilledBlock, kv: torch.Tensor) -> list[KVEvent]:
        events: list[KVEvent] = []
        while len(self._lru) >= self.max_blocks:
            old, _ = self._lru.popitem(last=False)
            self._path(old).unlink(missing_ok=True)
            events.append(BlockRemoved(old, 0, Tier.DISK))
        payload = kv.contiguous().view(torch.uint8).cpu().numpy().tobytes()
        try:
            self._write_atomically(block, payload)
        except OSError as e:  # a full or failing disk: the block is dropped, never half-kept
            log.warning("disk KV tier: could not write a block to %s: %s", self.dir, e)
            return events
        self._lru[block.block_hash] = block
        events.append(BlockStored(block.block_hash, block.parent_hash, block.token_ids, 0, Tier.DISK))
        return events

    def restore(self, block_hash: BlockHash, kv_cache: torch.Tensor,
                block_id: int) -> tuple[SpilledBlock, Tier, list[KVEvent]] | None:
        block = self._lru.pop(block_hash, None)
        if block is None:
            return None
        path = self._path(block_hash)
        read = self._read(path)
        path.unlink(missing_ok=True)
        if read is None:  # NOTE: its index key stays until the next resync: a miss then, never a wrong block
            log.warning("disk KV tier: %s fails its checks at restore; deleted, recomputed instead", path)
            self.skipped += 1
            return None
        _, payload = read
        rows = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self._dtype)
        kv_cache[:, :, block_id].copy_(rows.reshape(self._block_shape))
        return block, Tier.DISK, [BlockRemoved(block_hash, 0, Tier.DISK)]

    def keys(self) -> list[BlockHash]:
        return [index_key(h, Tier.DISK) for h in self._lru]

    def usage(self) -> TierUsage:
        return TierUsage(Tier.DISK, self.max_blocks, len(self._lru))

    # --- files ----------------------------------------------------------------------------------
    def _path(self, block_hash: BlockHash) -> Path:
        return self.dir / f"{block_hash.hex()}{SUFFIX}"

    def _write_atomically(self, block: SpilledBlock, payload: bytes) -> None:
        header = msgpack.packb({"v": VERSION, "layout": self.layout, "hash": block.block_hash,
                                "parent": block.parent_hash, "tokens": list(block.token_ids),
                                "nbytes": len(payload), "checksum": xxhash.xxh3_64_intdigest(payload)})
        temp = self.dir / f"{TEMP_PREFIX}{block.block_hash.hex()}-{os.getpid()}"
        with open(temp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header + payload)
        os.replace(temp, self._path(block.block_hash))

    def _read(self, path: Path) -> tuple[SpilledBlock, bytes] | None:
        """The file's block and KV bytes; None when it is unreadable, of another layout or corrupt."""
        try:
            data = path.read_bytes()
            if data[:4] != MAGIC:
                return None
            (n,) = struct.unpack("<I", data[4:8])
            h = msgpack.unpackb(data[8:8 + n])
            payload = data[8 + n:]
            if (h.get("v") != VERSION or h.get("layout") != self.layout or h.get("nbytes") != len(payload)
                    or xxhash.xxh3_64_intdigest(payload) != h.get("checksum")
                    or path.name != f"{bytes(h['hash']).hex()}{SUFFIX}"):
                return None
            parent = BlockHash(bytes(h["parent"])) if h["parent"] is not None else None
            return SpilledBlock(BlockHash(bytes(h["hash"])), parent, tuple(h["tokens"])), payload
        except (OSError, ValueError, KeyError, TypeError, struct.error, msgpack.UnpackException):
            return None

    def _scan(self) -> None:
        files = sorted(self.dir.iterdir(), key=lambda p: p.stat().st_mtime)
        for path in files:
            if not path.name.endswith(SUFFIX):  # a temp file a crash left (or something else): not ours
                if path.name.startswith(TEMP_PREFIX):
                    path.unlink(missing_ok=True)
                    self.skipped += 1
                continue
            read = self._read(path)
            if read is None:
                log.warning("disk KV tier: %s fails its checks (corrupt, or another layout); deleted", path)
                path.unlink(missing_ok=True)
                self.skipped += 1
                continue
            self._lru[read[0].block_hash] = read[0]
        while len(self._lru) > self.max_blocks:  # the bound shrank since the files were written
            old, _ = self._lru.popitem(last=False)
            self._path(old).unlink(missing_ok=True)
