"""The wire benchmark's reusable pieces: the hand-written KVChunk codec and a pool receiver
behind real gRPC on loopback, in both codecs."""

from concurrent import futures

import grpc
import pytest
import torch

from bench.kv_transfer_wire import (
    FINGERPRINT,
    GRPC_OPTIONS,
    PoolReceiver,
    add_pool_receiver,
    make_pool,
    parse_kv_chunk,
    push_pool,
    serialize_kv_chunk,
    transfer_frames,
)
from pdserve.kvwire import KVLayout, WireError
from protos.pdserve.v1 import kv_transfer_pb2 as pb


@pytest.mark.parametrize("header, payload", [(b"h", b""), (b"", b""),
                                             (b"\x00" * 200, bytes(range(256)) * 600)])
def test_hand_codec_is_byte_identical_to_protobuf(header, payload):
    wire = serialize_kv_chunk((header, payload))
    assert wire == pb.KVChunk(header=header, payload=payload).SerializeToString()
    assert tuple(map(bytes, parse_kv_chunk(wire))) == (header, payload)


def test_hand_parser_skips_unknown_fields_and_rejects_truncation():
    wire = b"\x18\x96\x01" + serialize_kv_chunk((b"h", b"pp")) + b"\x25\x00\x00\x00\x00"  # fields 3, 4
    assert tuple(map(bytes, parse_kv_chunk(wire))) == (b"h", b"pp")
    with pytest.raises(ValueError, match="claims"):
        parse_kv_chunk(serialize_kv_chunk((b"h", b"payload"))[:-1])


@pytest.mark.parametrize("codec", ["raw", "proto"])
def test_pool_receiver_over_grpc_is_bit_exact(codec):
    sender, receiver = make_pool(1, "bfloat16", layers=4), make_pool(1, "bfloat16", layers=4, fill=False)
    layout = KVLayout.of_cache(sender, FINGERPRINT)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
    add_pool_receiver(server, PoolReceiver(receiver, layout), codec)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        block_ids = list(reversed(range(sender.shape[2])))
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
            frames = transfer_frames(sender, layout, "t1", block_ids, range(len(block_ids)), 100_000)
            reply = push_pool(channel, frames, codec)
    finally:
        server.stop(grace=None)
    assert (reply.transfer_id, reply.blocks_written, reply.bytes_received) == ("t1", 4 * 4, 1 << 20)
    assert torch.equal(receiver.view(torch.uint8), sender.flip(2).view(torch.uint8))


def test_pool_receiver_fails_closed_on_a_missing_chunk():
    sender, receiver = make_pool(1, "float16", layers=4), make_pool(1, "float16", layers=4, fill=False)
    layout = KVLayout.of_cache(sender, FINGERPRINT)
    frames = list(transfer_frames(sender, layout, "t1", range(4), range(4), layout.block_bytes))
    assert len(frames) == 1 + 4 * 4 + 1  # BEGIN, one block per chunk, END
    del frames[2]
    with pytest.raises(WireError, match="END says 16 blocks / 1048576 bytes, got 15 / 983040"):
        PoolReceiver(receiver, layout).receive(frames)
