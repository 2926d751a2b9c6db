"""Chained block hashes: the one hashing module shared by workers and router.

A KV row is valid only while every token before it is unchanged, so a block's
identity is its own token ids *and* its whole prefix. Each full block's hash
covers (parent hash, token ids, salt):

    block 0: h0 = H(salt | ROOT | tokens[0:bs])
    block 1: h1 = H(salt | h0   | tokens[bs:2bs])
    block 2: h2 = H(salt | h1   | tokens[2bs:3bs])

Editing token i changes the hash of block i // bs and of every block after it.
The salt fingerprints what makes KV bytes comparable at all: model family,
weights, tokenizer, block size and KV dtype. Two engines with different salts never
share a hash. Partial (trailing) blocks get no hash: they are never shared.

A request may carry a cache_salt of its own (a tenant's, under --cache-isolation token):
its blocks are hashed with request_salt(engine salt, cache_salt), so requests with
different cache_salts never share a block, on any worker or in the index, and one
tenant cannot learn from cached_tokens what another has asked.

BlockHash names this identity in types, from the pool (block_pool.py, events.py) through the
prefix index (pdserve/index/) to the router's scorer: a block hash is never confused with a salt
or a fingerprint, which are bytes too.

Pure: imports only the standard library and the dtype table (pdserve/engine/config.py, itself
torch-free), so the router can hash without torch.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from typing import NewType, overload

from pdserve.engine.config import KV_DTYPE_TABLE

BlockHash = NewType("BlockHash", bytes)  # a full block's chained hash: HASH_BYTES bytes

HASH_BYTES = 16
ROOT_PARENT = BlockHash(b"\x00" * HASH_BYTES)


def engine_salt(model_fingerprint: str, block_size: int, kv_dtype: str, *,
                architecture: str = "llama") -> bytes:
    """The engine's salt, mixed into every block hash: what makes its KV bytes comparable at all
    (model family and model+tokenizer fingerprint, block size, the dtype's row format:
    pdserve/engine/config.py)."""
    # NOTE: the family is named beside the fingerprint, so two families never share a block even were
    # their fingerprints equal. Llama's salt names none: it is the salt from before families, as only
    # int8 names its later row format, and no other family's text can equal it (a fingerprint is hex).
    family = "" if architecture == "llama" else f"|arch={architecture}"
    text = (f"pdserve-kv-v1|{model_fingerprint}{family}|bs={block_size}"
            f"|dtype={KV_DTYPE_TABLE[kv_dtype].row_format}")
    return hashlib.sha256(text.encode()).digest()[:HASH_BYTES]


MAX_CACHE_SALT_BYTES = 64
# How the router picks a request's cache_salt. none: b"" for all, so any request may reuse any
# other's cached prefix; token: the digest of its API token, so only requests of one token share.
CACHE_ISOLATION = ("none", "token")


def request_salt(salt: bytes, cache_salt: bytes) -> bytes:
    """The salt of one request's block hashes: the engine's, keyed further by the request's
    cache_salt when it has one (b"": the engine's salt, shared by every request)."""
    if not cache_salt:
        return salt
    return hashlib.blake2b(cache_salt, digest_size=HASH_BYTES, key=salt).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], salt: bytes) -> BlockHash:
    """Hash one full block given its parent's hash (ROOT_PARENT for the first block)."""
    h = hashlib.blake2b(digest_size=HASH_BYTES, key=salt)
    h.update(parent)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return BlockHash(h.digest())


def hash_blocks(token_ids: Sequence[int], block_size: int, salt: bytes,
                parent: BlockHash = ROOT_PARENT) -> list[BlockHash]:
    """Hashes of every *full* block of token_ids, chained from parent."""
    n_full = len(token_ids) // block_size
    return _chain(hashlib.blake2b(digest_size=HASH_BYTES, key=salt), parent, token_ids[:n_full * block_size],
                  block_size)


class PromptHashes(Sequence[BlockHash]):
    """hash_blocks(token_ids, block_size, salt) as a sequence that hashes a block when it is first read.

    NOTE: the router's index match walks a prompt's blocks in order and stops at the first one no
    worker holds (pdserve/index/memory.py), so it never reads the hashes after it: a decision hashes
    the blocks some worker could reuse and one more chunk, not the whole prompt (a cold 4,096-token
    prompt: 16 of its 256 blocks). Reading a block hashes every block before it, CHUNK_BLOCKS at a time.
    """

    CHUNK_BLOCKS = 16  # blocks hashed per extension (one struct.pack each): 8 to 64 were within 15%

    def __init__(self, token_ids: Sequence[int], block_size: int, salt: bytes,
                 parent: BlockHash = ROOT_PARENT) -> None:
        self._tokens, self._block_size, self._parent = token_ids, block_size, parent
        self._keyed = hashlib.blake2b(digest_size=HASH_BYTES, key=salt)
        self._count = len(token_ids) // block_size
        self._hashes: list[BlockHash] = []

    @property
    def computed(self) -> int:
        """How many leading blocks have been hashed so far."""
        return len(self._hashes)

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> BlockHash: ...

    @overload
    def __getitem__(self, index: slice) -> list[BlockHash]: ...

    def __getitem__(self, index: int | slice) -> BlockHash | list[BlockHash]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._count)
            if stop > start:
                self._extend_to(stop if step > 0 else start + 1)
            return self._hashes[index]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(f"block {index} of a prompt with {self._count} full blocks")
        if index >= len(self._hashes):
            self._extend_to(index + 1)
        return self._hashes[index]

    def __iter__(self) -> Iterator[BlockHash]:
        """Every block's hash in order, each chunk hashed when the iteration reaches it."""
        done = 0
        while done < self._count:
            if done == len(self._hashes):
                self._extend_to(done + 1)
            chunk = self._hashes[done:]
            yield from chunk
            done += len(chunk)

    def _extend_to(self, blocks: int) -> None:
        done = len(self._hashes)
        end = min(self._count, max(blocks, done + self.CHUNK_BLOCKS))
        if end <= done:
            return
        parent = self._hashes[-1] if self._hashes else self._parent
        bs = self._block_size
        self._hashes += _chain(self._keyed, parent, self._tokens[done * bs:end * bs], bs)


def _chain(keyed: hashlib._Hash, parent: BlockHash, token_ids: Sequence[int], block_size: int
           ) -> list[BlockHash]:
    """The chained hashes of token_ids' blocks (its length a multiple of block_size), from parent.
    keyed: a blake2b state already keyed with the salt."""
    packed = memoryview(struct.pack(f"<{len(token_ids)}I", *token_ids))
    step = 4 * block_size
    # NOTE: one keyed state copied per block: keying a blake2b costs a whole compression of the key
    # block, a copy does not (0.37 -> 0.25 ms for a 4,096-token prompt; bench.router's hash_blocks).
    hashes: list[BlockHash] = []
    for start in range(0, len(packed), step):  # same bytes as hash_block, packed once
        h = keyed.copy()
        h.update(parent)
        h.update(packed[start:start + step])
        parent = BlockHash(h.digest())
        hashes.append(parent)
    return hashes


def tier_key(block_hash: BlockHash, tier_name: str) -> BlockHash:
    """The index key of a block held in a tier below the device pool ("host", "disk").

    NOTE: the prefix index stays a map of hashes to workers; a block in a lower tier is published
    under this derived key instead of its own, so a plain match counts device blocks only and the
    router asks for the lower-tier run after it (router/placement.py), crediting each tier at its
    own weight. The device tier's key is the block hash itself.
    """
    key = b"pdserve-tier:" + tier_name.encode()
    return BlockHash(hashlib.blake2b(block_hash, digest_size=HASH_BYTES, key=key).digest())
