"""KV wire codec: bit-exact round trips, fail-closed checks, header validation, layout checks."""

import dataclasses
import itertools

import msgpack
import pytest
import torch

from pdserve.engine import cpu_kernels
from pdserve.engine.kv_format import KV_FORMATS, TORCH_DTYPES
from pdserve.kvwire import (
    WIRE_VERSION,
    ChecksumError,
    KVLayout,
    LayerChunkHeader,
    TransferBegin,
    TransferEnd,
    WireError,
    decode_header,
    decode_layer,
    encode_layer,
    receive_layer,
    write_layer,
)
from pdserve.transfer.kvchunk import PackedFrame, parse_kv_chunk, serialize_kv_chunk

DTYPES = ["float32", "float16", "bfloat16", "int8", "fp8"]
# Both paths of encode_layer and receive_layer: kv_blocks.cpp (one pass a block) and the Python one
# (a device pool's, or a CPU's without pdserve's kernels). They carry the same frames.
needs_native = pytest.mark.skipif(cpu_kernels.kv_blocks() is None,
                                  reason=f"pdserve's CPU kernels: {cpu_kernels.unavailable()}")
NATIVE = pytest.param(True, id="native", marks=needs_native)
PATHS = [NATIVE, pytest.param(False, id="python")]


def make_pool(kv_dtype: str, num_blocks: int = 24, layers: int = 3, block_size: int = 4,
              kv_heads: int = 2, head_dim: int = 8, seed: int = 0, random: bool = True) -> torch.Tensor:
    """A pool kv[layer, K|V, block, offset, kv_head, row] of random bit patterns (NaNs included; an
    int8/fp8 row is head_dim codes and 4 scale bytes)."""
    dtype = TORCH_DTYPES[kv_dtype]
    shape = (layers, 2, num_blocks, block_size, kv_heads, KV_FORMATS[kv_dtype].row_width(head_dim))
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if not random:
        return torch.zeros(shape, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def layer_frames(pool, layer, block_ids, positions, max_chunk_bytes=2 << 20, native=True):
    """Decoded frames with their payloads copied out (the Python path's views are reused)."""
    return [(decode_header(h), bytes(p)) for h, p in encode_layer(pool, layer, block_ids, positions, "t1",
                                                                  max_chunk_bytes, native=native)]


@pytest.mark.parametrize("receive_native", PATHS)
@pytest.mark.parametrize("send_native", PATHS)
@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_round_trip_is_bit_exact_over_several_chunks(kv_dtype, send_native, receive_native):
    sender = make_pool(kv_dtype, num_blocks=24)
    receiver = make_pool(kv_dtype, num_blocks=40, random=False)
    layout = KVLayout.of_cache(sender, "fp")
    assert KVLayout.of_cache(receiver, "fp") == layout
    g = torch.Generator().manual_seed(1)
    send_ids = torch.randperm(24, generator=g)[:11].tolist()
    positions = torch.randperm(30, generator=g)[:11].tolist()
    recv_id_of = dict(zip(positions, torch.randperm(40, generator=g)[:11].tolist()))
    max_chunk = 3 * layout.block_bytes + layout.block_bytes // 2  # 3 whole blocks a chunk

    for layer in range(layout.num_layers):
        frames = layer_frames(sender, layer, send_ids, positions, max_chunk, native=send_native)
        assert [len(h.positions) for h, _ in frames] == [3, 3, 3, 2]
        for header, payload in frames:
            assert len(payload) == len(header.positions) * layout.block_bytes <= max_chunk
            assert header.layer == layer and header.transfer_id == "t1"
            receive_layer(receiver, header, payload, layout, [recv_id_of[p] for p in header.positions],
                          native=receive_native)

    for layer in range(layout.num_layers):
        for send_id, pos in zip(send_ids, positions):
            assert torch.equal(bits(receiver[layer, :, recv_id_of[pos]]), bits(sender[layer, :, send_id]))
    untouched = sorted(set(range(40)) - set(recv_id_of.values()))
    assert torch.count_nonzero(bits(receiver[:, :, untouched])) == 0


def test_a_chunk_holds_at_least_one_block():
    pool = make_pool("float16")
    layout = KVLayout.of_cache(pool, "fp")
    frames = layer_frames(pool, 0, [4, 2, 9], [0, 1, 2], max_chunk_bytes=1)
    assert [h.positions for h, _ in frames] == [(0,), (1,), (2,)]
    assert all(len(p) == layout.block_bytes for _, p in frames)


def test_payload_is_k_then_v_per_block_and_decode_is_zero_copy():
    pool = make_pool("float32")
    layout = KVLayout.of_cache(pool, "fp")
    (header, payload), = layer_frames(pool, 1, [7, 3], [0, 1])
    assert header.shape == (2, 2, 4, 2, 8) and header.dtype == "float32"
    expected = torch.stack([pool[1, :, 7], pool[1, :, 3]])
    assert bytes(payload) == bytes(bits(expected).numpy())
    buf = bytearray(payload)
    view = decode_layer(header, buf, layout)
    buf[:4] = b"\0\0\0\0"
    assert view[0, 0, 0, 0, 0].item() == 0.0  # the view reads the caller's buffer


@pytest.mark.parametrize("native", PATHS)
def test_flipped_byte_is_a_checksum_error_naming_the_block(native):
    pool, receiver = make_pool("bfloat16"), make_pool("bfloat16", random=False)
    layout = KVLayout.of_cache(pool, "fp")
    (header, payload), = layer_frames(pool, 2, [1, 5, 6], [4, 5, 6], native=native)
    corrupt = bytearray(payload)
    corrupt[layout.block_bytes + 17] ^= 0x01  # inside the second block, position 5
    with pytest.raises(ChecksumError, match=r"layer 2, block position 5") as info:
        decode_layer(header, bytes(corrupt), layout)
    assert (info.value.layer, info.value.position) == (2, 5)
    with pytest.raises(ChecksumError, match=r"layer 2, block position 5") as info:
        receive_layer(receiver, header, bytes(corrupt), layout, [10, 11, 12], native=native)
    assert (info.value.layer, info.value.position) == (2, 5)
    assert torch.count_nonzero(bits(receiver[:, :, 11:])) == 0  # the bad block and those after: never written
    # the block before it verified: the native path has written it, the Python path writes none of a bad frame
    before = bits(receiver[2, :, 10])
    assert torch.equal(before, bits(pool[2, :, 1])) if native else torch.count_nonzero(before) == 0


@pytest.mark.parametrize("native", PATHS)
def test_truncated_payload_is_a_wire_error(native):
    pool, receiver = make_pool("float16"), make_pool("float16", random=False)
    layout = KVLayout.of_cache(pool, "fp")
    (header, payload), = layer_frames(pool, 0, [1, 2], [0, 1], native=native)
    with pytest.raises(WireError, match="truncated") as info:
        decode_layer(header, payload[:-1], layout)
    assert not isinstance(info.value, ChecksumError)
    with pytest.raises(WireError, match="truncated"):
        receive_layer(receiver, header, payload[:-1], layout, [3, 4], native=native)
    assert torch.count_nonzero(bits(receiver)) == 0


@pytest.mark.parametrize("change, message", [
    ({"dtype": "float16"}, "dtype float16, the receiver's pool holds float32"),
    ({"layer": 3}, "model has 3 layers"),
    ({"shape": (1, 2, 8, 2, 8)}, "block shape"),
])
def test_chunk_that_does_not_fit_the_receiver_layout_is_refused(change, message):
    pool = make_pool("float32")
    layout = KVLayout.of_cache(pool, "fp")
    (header, payload), = layer_frames(pool, 0, [1], [0])
    with pytest.raises(WireError, match=message):
        decode_layer(dataclasses.replace(header, **change), payload, layout)


@pytest.mark.parametrize("pool_in_inference_mode", [True, False])
def test_codec_works_inside_and_outside_inference_mode(pool_in_inference_mode):
    with torch.inference_mode(pool_in_inference_mode):
        sender, receiver = make_pool("float16"), make_pool("float16", random=False)
    layout = KVLayout.of_cache(sender, "fp")
    with torch.inference_mode():  # the engine's layer hook starts the generator...
        chunks = encode_layer(sender, 1, [3, 4, 5], [0, 1, 2], "t1", max_chunk_bytes=1)
        h, p = next(chunks)
        first = (h, bytes(p))  # kept past the next frame: copied out of the reused staging buffer
    for h, p in itertools.chain([first], chunks):  # ...a sender thread outside inference mode finishes it
        header = decode_header(h)
        write_layer(receiver, 1, [pos + 10 for pos in header.positions], decode_layer(header, p, layout))
    assert torch.equal(bits(receiver[1, :, 10:13]), bits(sender[1, :, 3:6]))


def test_a_payload_kept_past_the_next_frame_is_rejected_not_used():
    """The Python path's payloads are views of one staging buffer."""
    sender = make_pool("float16")
    layout = KVLayout.of_cache(sender, "fp")
    frames = list(encode_layer(sender, 0, [1, 2], [0, 1], "t1", max_chunk_bytes=layout.block_bytes,
                               native=False))
    header = decode_header(frames[0][0])  # its payload view now holds block 2, sent as frame 1
    with pytest.raises(ChecksumError, match="block position 0"):
        decode_layer(header, frames[0][1], layout)
    assert frames[0][1].readonly  # and nobody can write into the sender's staging buffer through it


@pytest.mark.parametrize("kv_dtype", DTYPES)
@needs_native
def test_a_native_frame_is_its_own_message_with_the_python_paths_content(kv_dtype):
    """kv_blocks.cpp's frames: each a whole KVChunk message that serialising hands over without a
    copy, whose header and payload say what the Python path's say (its checksums fixed-width)."""
    sender = make_pool(kv_dtype)
    layout = KVLayout.of_cache(sender, "fp")
    ids, positions = [5, 1, 9, 2, 7], [3, 4, 5, 6, 7]
    native = list(encode_layer(sender, 1, ids, positions, "t1", 2 * layout.block_bytes))
    python = [(bytes(h), bytes(p)) for h, p in encode_layer(sender, 1, ids, positions, "t1",
                                                            2 * layout.block_bytes, native=False)]
    assert all(isinstance(frame, PackedFrame) for frame in native) and len(native) == len(python) == 3
    for frame, (header, payload) in zip(native, python):
        assert serialize_kv_chunk(frame) is frame.message
        assert [bytes(part) for part in parse_kv_chunk(frame.message)] == [bytes(frame[0]), bytes(frame[1])]
        assert decode_header(frame[0]) == decode_header(header) and bytes(frame[1]) == payload
    first = decode_header(native[0][0])  # kept past the next frames, it still verifies: nothing reuses it
    expected = sender[1, :, [5, 1]].transpose(0, 1)
    assert torch.equal(bits(decode_layer(first, native[0][1], layout)), bits(expected))


def test_write_layer_refuses_wrong_shape_dtype_and_repeated_ids():
    pool = make_pool("float16")
    blocks = pool[0, :, :2].transpose(0, 1)
    with pytest.raises(ValueError, match="pool layer 0 needs"):
        write_layer(pool, 0, [1, 2, 3], blocks)
    with pytest.raises(ValueError, match="pool layer 0 needs"):
        write_layer(pool, 0, [1, 2], blocks.float())
    with pytest.raises(ValueError, match="repeat"):
        write_layer(pool, 0, [1, 1], blocks)


LAYOUT = KVLayout("f" * 64, 16, "float16", 30, 3, 64)


def begin(**change) -> TransferBegin:
    fields = dict(transfer_id="t1", request_id="r1", layout=LAYOUT, prompt_token_ids=(1, 2, 3) * 20,
                  num_tokens=60, decode_cached_blocks=1, positions=(1, 2, 3), first_token=None)
    return TransferBegin(**{**fields, **change})


@pytest.mark.parametrize("frame", [
    begin(),
    begin(first_token=42),
    LayerChunkHeader("t1", 4, (1, 2), "bfloat16", (2, 2, 16, 3, 64), (0, 2**64 - 1)),
    TransferEnd("t1", 90, 12345),
])
def test_headers_round_trip(frame):
    assert decode_header(frame.encode()) == frame


def test_begin_positions_must_lie_inside_the_prompt():
    with pytest.raises(WireError, match=r"positions \[4\] outside the 4 blocks"):
        begin(positions=(3, 4))
    with pytest.raises(WireError, match="repeat"):
        begin(positions=(1, 1))


def pack(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


GOOD_LAYER = dict(v=WIRE_VERSION, kind="layer", transfer_id="t", layer=0, positions=[0], dtype="float16",
                  shape=[1, 2, 16, 3, 64], checksums=[7])


@pytest.mark.parametrize("data, message", [
    (b"\xc1", "not valid msgpack"),
    (pack(v=WIRE_VERSION, kind=b"\xff"), "'kind' must be a str"),
    (b"\x82\xa1v\x01\xa4kind\xa3\xff\xfe\xfd", "not valid msgpack"),
    (b"", "not valid msgpack"),
    (pack(**GOOD_LAYER) + b"\x00", "not valid msgpack"),
    (msgpack.packb([1, "layer"]), "expected a msgpack map"),
    (pack(kind="layer"), "'v' is missing"),
    (pack(**{**GOOD_LAYER, "v": 9}), f"wire version 9, this receiver speaks {WIRE_VERSION}"),
    (pack(**{**GOOD_LAYER, "v": "1"}), "'v' must be an int"),
    (pack(**{**GOOD_LAYER, "kind": "middle"}), "kind 'middle'"),
    (pack(**{k: v for k, v in GOOD_LAYER.items() if k != "checksums"}), "'checksums' is missing"),
    (pack(**{**GOOD_LAYER, "layer": "0"}), "'layer' must be an int"),
    (pack(**{**GOOD_LAYER, "layer": True}), "'layer' must be an int"),
    (pack(**{**GOOD_LAYER, "positions": [0.5]}), "'positions' must be a list of ints"),
    (pack(**{**GOOD_LAYER, "checksums": [1, 2]}), "need 1 checksums"),
    (pack(**{**GOOD_LAYER, "checksums": [-1]}), r"checksums in \[0, 2\*\*64\)"),
    (pack(**{**GOOD_LAYER, "shape": [1, 3, 16, 3, 64]}), "is not \\[1 blocks, 2"),
    (pack(**{**GOOD_LAYER, "positions": [], "shape": [0, 2, 16, 3, 64], "checksums": []}), "is not"),
    (pack(**{**GOOD_LAYER, "dtype": "int4"}), "dtype 'int4'"),
    (pack(v=WIRE_VERSION, kind="end", transfer_id="t", total_blocks=-1, total_bytes=0), "negative totals"),
    (pack(v=WIRE_VERSION, kind="begin", transfer_id="t", request_id="r", layout={"block_size": 16},
          prompt_token_ids=[], num_tokens=0, decode_cached_blocks=0, positions=[]),
     "layout: field 'model_fingerprint' is missing"),
])
def test_malformed_headers_are_wire_errors(data, message):
    with pytest.raises(WireError, match=message):
        decode_header(data)


def test_begin_with_a_bad_layout_value_is_a_wire_error():
    fields = msgpack.unpackb(begin().encode())
    data = pack(**{**fields, "layout": {**fields["layout"], "kv_dtype": "int4"}})
    with pytest.raises(WireError, match="layout: kv_dtype 'int4' is not one of"):
        decode_header(data)


@pytest.mark.parametrize("field, value", [
    ("model_fingerprint", "e" * 64), ("block_size", 32), ("kv_dtype", "bfloat16"), ("kv_dtype", "int8"),
    ("kv_dtype", "fp8"), ("num_layers", 31),
    ("num_kv_heads", 4), ("head_dim", 128), ("wire_version", WIRE_VERSION + 1),
])
def test_first_mismatch_names_the_differing_field(field, value):
    other = dataclasses.replace(LAYOUT, **{field: value})
    assert other.first_mismatch(LAYOUT).startswith(f"{field}: sender ")
    assert LAYOUT.first_mismatch(LAYOUT) is None


def test_first_mismatch_reports_fields_in_order_and_shortens_fingerprints():
    receiver = KVLayout("def" + "0" * 61, 32, "bfloat16", 2, 3, 64)
    expected = "model_fingerprint: sender ffffffffffff…, receiver def000000000…"
    assert LAYOUT.first_mismatch(receiver) == expected
    sender = dataclasses.replace(receiver, block_size=16, kv_dtype="float16", num_layers=4)
    assert sender.first_mismatch(receiver) == "block_size: sender 16, receiver 32"


def test_layout_dict_round_trip_and_validation():
    assert KVLayout.from_dict(LAYOUT.to_msgpack_dict()) == LAYOUT
    assert LAYOUT.block_bytes == 2 * 16 * 3 * 64 * 2
    with pytest.raises(WireError, match="layout: field 'head_dim' must be an int"):
        KVLayout.from_dict({**LAYOUT.to_msgpack_dict(), "head_dim": 64.0})
    with pytest.raises(WireError, match="block_size must be >= 1"):
        KVLayout.from_dict({**LAYOUT.to_msgpack_dict(), "block_size": 0})
    with pytest.raises(ValueError, match="expected a KV pool"):
        KVLayout.of_cache(torch.zeros(2, 3, 4), "fp")
    with pytest.raises(ValueError, match="no wire name"):
        KVLayout.of_cache(torch.zeros(1, 2, 1, 1, 1, 1, dtype=torch.float64), "fp")


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_a_quantized_block_travels_with_its_scales(kv_dtype):
    """An int8/fp8 block on the wire is its K rows then its V rows, each row head_dim codes and the
    row's float32 scale: 2 x block_size x kv_heads x (head_dim + 4) bytes, all under the block's
    checksum. The receiving pool reads back the sender's values."""
    fmt = KV_FORMATS[kv_dtype]
    sender, receiver = make_pool(kv_dtype, random=False), make_pool(kv_dtype, random=False)
    values = torch.randn(3, 2, 24, 4, 2, 8, generator=torch.Generator().manual_seed(3))
    sender.copy_(fmt.store(values))
    layout = KVLayout.of_cache(sender, "fp")
    assert (layout.head_dim, layout.block_bytes) == (8, 2 * 4 * 2 * (8 + 4))
    (header, payload), = layer_frames(sender, 2, [5, 9], [0, 1])
    assert header.dtype == kv_dtype and header.shape == (2, 2, 4, 2, 12)
    write_layer(receiver, 2, [0, 1], decode_layer(header, payload, layout))
    assert torch.equal(fmt.load(receiver[2, :, :2]), fmt.load(sender[2, :, [5, 9]]))
    scale_byte = layout.block_bytes - 1  # the last V row's scale, in the first block
    corrupt = bytearray(payload)
    corrupt[scale_byte] ^= 0x40
    with pytest.raises(ChecksumError, match="block position 0"):
        decode_layer(header, bytes(corrupt), layout)


def test_layouts_count_the_scales():
    assert dataclasses.replace(LAYOUT, kv_dtype="int8").block_bytes == 2 * 16 * 3 * (64 + 4)
    assert dataclasses.replace(LAYOUT, kv_dtype="fp8").block_bytes == 2 * 16 * 3 * (64 + 4)
    assert dataclasses.replace(LAYOUT, kv_dtype="float32").block_bytes == 2 * 16 * 3 * 64 * 4


def test_begin_carries_the_requests_cache_salt():
    frame = begin(cache_salt=b"\x00tenant\xff")
    assert decode_header(frame.encode()) == frame
    fields = msgpack.unpackb(frame.encode(), raw=False)
    with pytest.raises(WireError, match="'cache_salt' must be bytes"):
        decode_header(pack(**{**fields, "cache_salt": "text"}))


def test_a_layout_names_its_row_format_and_a_peer_without_one_has_the_dtypes_first():
    """int8's rows changed encoding: an int8 BEGIN from a peer that predates row formats is refused,
    naming row_format; a float16 one (the only encoding float16 has had) still matches."""
    assert LAYOUT.row_format == "float16"
    int8 = dataclasses.replace(LAYOUT, kv_dtype="int8", row_format=None)
    assert int8.row_format == "int8-hadamard-affine-own-row"
    assert KVLayout.from_dict(int8.to_msgpack_dict()) == int8
    legacy = {k: v for k, v in int8.to_msgpack_dict().items() if k != "row_format"}
    mismatch = KVLayout.from_dict(legacy).first_mismatch(int8)
    assert mismatch.startswith("row_format: sender int8, receiver int8-")
    legacy = {k: v for k, v in LAYOUT.to_msgpack_dict().items() if k != "row_format"}
    assert KVLayout.from_dict(legacy).first_mismatch(LAYOUT) is None
