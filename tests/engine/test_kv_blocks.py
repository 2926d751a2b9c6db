"""kv_blocks.cpp: its xxh3_64 is the xxhash package's, and its two passes refuse what does not fit.

The frames it packs and the blocks it verifies and writes are compared with the Python path's in
tests/test_kvwire.py (every KV dtype, both directions)."""

import numpy as np
import pytest
import torch
import xxhash

from pdserve.engine import cpu_kernels

kv_blocks = cpu_kernels.kv_blocks()
pytestmark = pytest.mark.skipif(kv_blocks is None,
                                reason=f"pdserve's CPU kernels: {cpu_kernels.unavailable()}")

# SmolLM2's block (16 tokens x 3 KV heads x 64) in float32 and in int8 with its scales, and
# bench.kv_transfer_wire's Llama-like float16 block: the sizes the pools send.
BLOCK_BYTES = [2 * 16 * 3 * 64 * 4, 2 * 16 * 3 * (64 + 4), 2 * 16 * 8 * 128 * 2]


def test_its_checksum_is_xxh3_64_for_every_length_and_alignment():
    data = np.random.default_rng(0).integers(0, 256, 70_000, dtype=np.uint8).tobytes()
    lengths = [*range(4_200), *BLOCK_BYTES, 65_537]  # every short path, every stripe/round boundary
    pieces = [(n, data[offset:offset + n]) for n in lengths for offset in (0, 3)]
    wrong = [n for n, piece in pieces if kv_blocks.checksum(piece) != xxhash.xxh3_64_intdigest(piece)]
    assert wrong == []


def _pool(num_blocks=6):
    return torch.arange(2 * num_blocks * 4 * 8, dtype=torch.float32).view(2, num_blocks, 4, 8)


def test_packing_refuses_block_ids_outside_the_pool_and_a_prefix_without_placeholders():
    pool, prefix = _pool(), b"\x00" * 7 + b"\xcf" + b"\x00" * 8
    assert len(kv_blocks.pack_layer_frame(pool, [5], prefix, 8)) == len(prefix) + 2 * 4 * 8 * 4
    with pytest.raises(RuntimeError, match="block id 6 is outside the pool's 6 blocks"):
        kv_blocks.pack_layer_frame(pool, [6], prefix, 8)
    with pytest.raises(RuntimeError, match="placeholder 0 is not a msgpack uint 64"):
        kv_blocks.pack_layer_frame(pool, [1], prefix, 7)
    with pytest.raises(RuntimeError, match="do not fit a prefix of 16 bytes"):
        kv_blocks.pack_layer_frame(pool, [1, 2], prefix, 8)


def test_verifying_refuses_a_payload_of_another_size_and_writes_nothing_unverified():
    pool, into = _pool(), torch.zeros(2, 6, 4, 8)
    block = torch.cat([pool[0, 2].reshape(-1), pool[1, 2].reshape(-1)]).numpy().tobytes()
    good = kv_blocks.checksum(block)
    with pytest.raises(RuntimeError, match="the payload has 255 bytes, 1 blocks of 256 need 256"):
        kv_blocks.verify_write_layer(block[:-1], [good], into, [4])
    assert kv_blocks.verify_write_layer(block + block, [good, good ^ 1], into, [4, 5]) == 1
    assert torch.equal(into[:, 4], pool[:, 2]) and torch.count_nonzero(into[:, 5]) == 0
