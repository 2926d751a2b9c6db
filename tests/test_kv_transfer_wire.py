"""The wire benchmark: sim/measure/wire.py's pool receiver behind real gRPC on loopback, in both codecs (the
hand-written one is tested in tests/transfer/test_kvchunk.py), and its stage timings."""

from concurrent import futures

import grpc
import pytest
import torch

from bench.kv_transfer_wire import measure_stages, push_pool
from pdserve.kvwire import KVLayout
from sim.measure.wire import (
    FINGERPRINT,
    GRPC_OPTIONS,
    PoolReceiver,
    add_pool_receiver,
    make_pool,
    transfer_frames,
)


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("codec", ["raw", "proto"])
def test_pool_receiver_over_grpc_is_bit_exact(codec, native):
    sender, receiver = make_pool(1, "bfloat16", layers=4), make_pool(1, "bfloat16", layers=4, fill=False)
    layout = KVLayout.of_cache(sender, FINGERPRINT)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
    add_pool_receiver(server, PoolReceiver(receiver, layout, native), codec)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        block_ids = list(reversed(range(sender.shape[2])))
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
            frames = transfer_frames(sender, layout, "t1", block_ids, range(len(block_ids)), 100_000, native)
            reply = push_pool(channel, frames, codec)
    finally:
        server.stop(grace=None)
    assert (reply.transfer_id, reply.blocks_written, reply.bytes_received) == ("t1", 4 * 4, 1 << 20)
    assert torch.equal(receiver.view(torch.uint8), sender.flip(2).view(torch.uint8))


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_the_stage_timings_drive_production_encode_and_receive_end_to_end(native):
    """--stages times production's pieces: the last stage's receive leaves its pool equal to the
    sender's, so a stage that skipped or broke a step would fail here, not report a fast time."""
    sender, receiver = make_pool(1, "float16", layers=4), make_pool(1, "float16", layers=4, fill=False)
    layout = KVLayout.of_cache(sender, FINGERPRINT)
    block_ids = list(reversed(range(sender.shape[2])))
    stages = measure_stages(sender, layout, block_ids, 100_000, 1, receiver, native)
    names = ("encode", "encode_serialize", "verify", "verify_write")
    assert set(stages) == {f"stage_{n}_s_per_gb" for n in names}
    assert all(v > 0 for v in stages.values())
    assert torch.equal(receiver.view(torch.uint8), sender.flip(2).view(torch.uint8))
