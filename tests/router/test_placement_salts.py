"""Prefix placement hashes a prompt with the salt of the workers it scores, as their registry entries
publish it: never the first worker's fingerprint with a KV dtype of the router's own.

Workers whose salts differ (a rolling upgrade to new weights, another KV dtype) hash the same prompt
to different blocks, so each salt group is matched with its own hashes, and a prefill worker only
ever feeds a decode worker of its own group (the KV layouts of two groups differ: a transfer
between them would be refused and recomputed).
"""

from __future__ import annotations

import random

import pytest

from pdserve.engine.hashing import engine_salt, hash_blocks
from pdserve.index.base import WorkerKey
from pdserve.index.memory import InMemoryPrefixIndex
from pdserve.index.registry import WorkerInfo
from router.config import PlacementConfig
from router.placement import Placer
from router.workers import WorkerDirectory

BLOCK_SIZE = 16
PROMPT = list(range(1000, 1000 + 40 * BLOCK_SIZE))  # 40 blocks: long enough for a remote prefill


def record(worker_id: str, role: str, fingerprint: str, kv_dtype: str) -> WorkerInfo:
    """The registry entry such a worker publishes."""
    salt = engine_salt(fingerprint, BLOCK_SIZE, kv_dtype)
    return WorkerInfo(worker_id, role, f"{worker_id}:1", "node", fingerprint, BLOCK_SIZE, kv_dtype,
                      salt.hex(), num_blocks=4096, epoch=1)


def holding(index: InMemoryPrefixIndex, worker: WorkerInfo, blocks: int) -> None:
    """worker holds the first `blocks` blocks of PROMPT, hashed as that worker hashes them."""
    index.set_live(WorkerKey(worker.worker_id, worker.epoch), ttl_s=3600.0)
    hashes = hash_blocks(PROMPT, worker.block_size, bytes.fromhex(worker.salt))
    index.apply(WorkerKey(worker.worker_id, worker.epoch), hashes[:blocks], [])


@pytest.fixture
def place():
    directories = []

    def place(workers: list[WorkerInfo], index: InMemoryPrefixIndex, busy: dict[str, int] | None = None):
        directory = WorkerDirectory(lambda: workers)
        directory.refresh()  # static records: the refresh thread is not started
        directories.append(directory)
        placer = Placer(directory, PlacementConfig(), index.match, rng=random.Random(0))
        loads = [c for c in [*directory.candidates("decode"), *directory.candidates("prefill")]
                 if (busy or {}).get(c.worker_id)]
        with directory.track(*[c for c in loads for _ in range(busy[c.worker_id])]):
            return placer.place(PROMPT)

    yield place
    for directory in directories:
        directory.stop()


def test_a_worker_whose_kv_dtype_is_not_the_routers_default_is_matched(place):
    index = InMemoryPrefixIndex(clock=lambda: 0.0)
    d0, d1 = record("d0", "decode", "smol", "bfloat16"), record("d1", "decode", "smol", "bfloat16")
    holding(index, d1, 39)
    placement = place([d0, d1], index)
    assert (placement.decode.worker_id, placement.decode_cached_blocks) == ("d1", 39)


def test_during_a_rolling_upgrade_each_salt_group_is_matched_with_its_own_hashes(place):
    index = InMemoryPrefixIndex(clock=lambda: 0.0)
    old, new = record("d-old", "decode", "weights-v1", "float32"), record("d-new", "decode", "weights-v2",
                                                                           "float32")
    holding(index, new, 39)
    # d-new is busier, so only its cached prefix can make it the cheaper choice; d-old, listed first,
    # is the worker whose salt a router taking workers[0]'s would hash with.
    placement = place([old, new], index, busy={"d-new": 1})
    assert (placement.decode.worker_id, placement.decode_cached_blocks) == ("d-new", 39)


def test_a_prefill_worker_never_feeds_a_decode_worker_of_another_salt(place):
    index = InMemoryPrefixIndex(clock=lambda: 0.0)
    decode, prefill = record("d-new", "decode", "weights-v2", "float32"), record("p-old", "prefill",
                                                                                  "weights-v1", "float32")
    placement = place([decode, prefill], index)
    assert (placement.decode.worker_id, placement.prefill) == ("d-new", None)
    same = record("p-new", "prefill", "weights-v2", "float32")
    placement = place([decode, prefill, same], index)
    assert (placement.decode.worker_id, placement.prefill.worker_id) == ("d-new", "p-new")
