"""KVChunk messages written and read by hand: the codec both gRPC ends of KVTransfer.Push use.

KVChunk (protos/pdserve/v1/kv_transfer.proto) is `bytes header = 1; bytes payload = 2;`.
On the wire that is

    0x0A  varint len(header)  header bytes  0x12  varint len(payload)  payload bytes

so a message is built with one join (the payload is copied once, straight from the sender's
staging buffer), or comes whole from kv_blocks.cpp as a PackedFrame (pdserve/kvwire.py
encode_layer), and is parsed into two memoryviews of gRPC's received bytes (no copy at all).
The generated class copies the payload into the message and again to serialise it, and once
more when parsing (measured: 4 GB/s to serialise, 6 GB/s to parse, against 11 GB/s and
~60 GB/s here; `python -m bench.kv_transfer_wire --codec proto` times it end to end).

The bytes are protobuf's own (tests/transfer/test_kvchunk.py checks both directions against
the generated class), so either end may use either codec.
"""

from __future__ import annotations

# NOTE: a payload may be a memoryview that the sender reuses for its next frame (see
# pdserve.kvwire.encode_layer): serialising copies it out before the next frame is pulled.
PUSH_METHOD = "/pdserve.v1.KVTransfer/Push"  # the full gRPC method name both ends register

BytesLike = bytes | bytearray | memoryview
FrameParts = tuple[BytesLike, BytesLike]


def serialize_kv_chunk(frame: FrameParts) -> bytes:
    """(header, payload) -> the KVChunk message bytes; empty fields are left out, as protobuf does."""
    if isinstance(frame, PackedFrame):
        return frame.message
    header, payload = frame
    header_len, payload_len = memoryview(header).nbytes, memoryview(payload).nbytes
    parts: list[BytesLike] = [b"\x0a", _varint(header_len), header] if header_len else []
    if payload_len:
        parts += [b"\x12", _varint(payload_len), payload]
    return b"".join(parts)


class PackedFrame(tuple):
    """A frame whose KVChunk message is built already (pdserve/kvwire.py encode_layer, by
    kv_blocks.cpp): (header, payload) are views of `message`, and serialize_kv_chunk hands the
    message over as it is, with no copy. Anything that rebuilds the frame (a fault plan that
    corrupts a payload) makes a plain tuple, which is serialised the usual way."""

    message: bytes

    def __new__(cls, message: bytes) -> PackedFrame:
        frame = super().__new__(cls, parse_kv_chunk(message))
        frame.message = message
        return frame


def message_prefix(header: bytes, payload_nbytes: int) -> tuple[bytes, int]:
    """The bytes of a KVChunk message before its payload, and where in them the header ends."""
    head = b"\x0a" + _varint(len(header)) + header
    return head + b"\x12" + _varint(payload_nbytes), len(head)


def parse_kv_chunk(data: bytes) -> tuple[memoryview, memoryview]:
    """(header, payload) as views of `data`; unknown fields skipped, the last of a repeat wins.
    ValueError on bytes that are not a KVChunk."""
    view, pos = memoryview(data), 0
    fields: dict[int, memoryview] = {1: view[:0], 2: view[:0]}
    while pos < len(view):
        key, pos = _read_varint(view, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _read_varint(view, pos)
            continue
        if wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
            continue
        if wire_type != 2:
            raise ValueError(f"KVChunk: wire type {wire_type} of field {number} is not protobuf 3")
        size, pos = _read_varint(view, pos)
        if pos + size > len(view):
            raise ValueError(f"KVChunk: field {number} claims {size} bytes, {len(view) - pos} left")
        fields[number], pos = view[pos:pos + size], pos + size
    if pos > len(view):
        raise ValueError(f"KVChunk: the last field runs {pos - len(view)} bytes past the message")
    return fields[1], fields[2]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(view):
        byte = view[pos]
        value, pos, shift = value | (byte & 0x7F) << shift, pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos
    raise ValueError("KVChunk: truncated varint")
