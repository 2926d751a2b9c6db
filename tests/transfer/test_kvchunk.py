"""The hand-written KVChunk codec is protobuf's own bytes, both ways (pdserve/transfer/kvchunk.py)."""

import pytest

from pdserve.transfer.kvchunk import parse_kv_chunk, serialize_kv_chunk
from protos.pdserve.v1 import kv_transfer_pb2 as pb


@pytest.mark.parametrize("header, payload", [(b"h", b""), (b"", b""),
                                             (b"\x00" * 200, bytes(range(256)) * 600)])
def test_hand_codec_is_byte_identical_to_protobuf(header, payload):
    wire = serialize_kv_chunk((header, payload))
    assert wire == pb.KVChunk(header=header, payload=payload).SerializeToString()
    assert tuple(map(bytes, parse_kv_chunk(wire))) == (header, payload)
    parsed = pb.KVChunk.FromString(wire)
    assert (parsed.header, parsed.payload) == (header, payload)


def test_a_memoryview_payload_serialises_like_bytes_and_is_copied_out():
    staging = bytearray(b"abcdef" * 1000)
    wire = serialize_kv_chunk((b"h", memoryview(staging)[6:]))
    staging[6:12] = b"XXXXXX"  # the sender reuses its staging buffer for the next frame
    assert wire == pb.KVChunk(header=b"h", payload=b"abcdef" * 999).SerializeToString()


def test_parsed_fields_are_views_of_the_received_bytes():
    wire = serialize_kv_chunk((b"h", b"payload"))
    header, payload = parse_kv_chunk(wire)
    assert isinstance(payload, memoryview) and payload.obj is wire


def test_hand_parser_skips_unknown_fields_and_rejects_truncation():
    wire = b"\x18\x96\x01" + serialize_kv_chunk((b"h", b"pp")) + b"\x25\x00\x00\x00\x00"  # fields 3, 4
    assert tuple(map(bytes, parse_kv_chunk(wire))) == (b"h", b"pp")
    with pytest.raises(ValueError, match="claims"):
        parse_kv_chunk(serialize_kv_chunk((b"h", b"payload"))[:-1])
    with pytest.raises(ValueError, match="truncated varint"):
        parse_kv_chunk(b"\x0a\x80")
