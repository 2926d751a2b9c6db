"""match() stays one fast round trip for a 4,096-token prompt (256 blocks) and 16 workers.

Prints p50/p99; asserts only a loose bound (the test machines are shared), so that an
accidental O(blocks x workers) round trips or a quadratic walk fails loudly.
"""

from __future__ import annotations

import random
import time

import pytest

from loadtest.stats import percentile
from pdserve.engine.hashing import engine_salt, hash_blocks
from pdserve.index.base import WorkerKey
from pdserve.index.redis_index import RedisPrefixIndex

SALT = engine_salt("latency", 16, "float16")


@pytest.mark.slow
def test_match_256_blocks_16_workers(redis_client, namespace):
    rng = random.Random(0)
    tokens = lambda: [rng.randrange(49152) for _ in range(4096)]
    index = RedisPrefixIndex(redis_client, namespace)
    workers = [WorkerKey(f"worker-{i:02d}", 1) for i in range(16)]
    for w in workers:
        index.set_live(w, 60.0)
    for _ in range(20):  # other prompts, so the sets are not all alone in the store
        other = hash_blocks(tokens(), 16, SALT)
        for w in rng.sample(workers, 4):
            index.apply(w, other, [])
    prompt = hash_blocks(tokens(), 16, SALT)
    for i, w in enumerate(workers):
        index.apply(w, prompt[: 16 * (i + 1)], [])
    assert index.match(prompt) == {w.worker_id: 16 * (i + 1) for i, w in enumerate(workers)}

    samples = []
    for _ in range(200):
        start = time.perf_counter()
        index.match(prompt)
        samples.append(time.perf_counter() - start)

    p50, p99 = percentile(samples, 50) * 1e3, percentile(samples, 99) * 1e3
    print(f"match, 256 blocks, 16 workers at depths 16..256: p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    assert p50 < 50, f"match p50 {p50:.1f} ms: is it still one EVALSHA walking per worker?"
