"""KV block codec: the frames a prefill worker streams to a decode worker (no network here).

One transfer is one `KVTransfer.Push` call: a stream of (header, payload) frames, in order

    BEGIN                      header only: ids, the sender's KVLayout, the prompt, and the
                               sequence block positions that will follow
    LAYER x (layers x chunks)  header + payload: some of those blocks, for one layer
    END                        header only: totals, so a lost or extra frame is noticed

Headers are msgpack maps carrying "v" (WIRE_VERSION) and "kind". A LAYER payload is one
contiguous tensor [n_blocks, 2, block_size, kv_heads, row] in the pool's dtype, a row being
head_dim values or, for int8/fp8, head_dim codes and their scale (int8: and offset;
pdserve/engine/kv_format.py), so each block, scales included, is one byte range with its
own checksum:

    payload  | pos p0: K rows | V rows | pos p1: K rows | V rows | ...
             '------ block_bytes -----'
    checksums[i] = xxh3_64(bytes of block i)

The checksums are the LAYER header's last field. pdserve packs each as a msgpack uint 64 (0xcf and
8 bytes, big-endian) whatever its value, which msgpack allows and every reader accepts: the header's
length is then known before any block is hashed, so kv_blocks.cpp can write a frame's whole message
in one pass (encode_layer). The Python path packs the same values msgpack's own way.

Fail closed: a receiver that sees a malformed header, a layout that differs from its own
(`KVLayout.first_mismatch`), a short payload or a bad checksum (`WireError`, `ChecksumError`)
writes nothing further, frees its reservation and fails the call; the caller recomputes the
prompt. A block that did not verify is never used, so the output stays exact.

Compatibility: WIRE_VERSION covers the header schema, the payload layout and the checksum
algorithm. Changing any of them (xxh3_64 -> crc32 included) is a new version. A new KV dtype
is not: its name travels in the layout, which both ends must share, and a receiver that does
not know the name refuses the BEGIN (fail closed, tests/test_kvwire.py). Nor is a new encoding of
a dtype's rows: the layout's row_format names it (pdserve/engine/config.py KVDtype), and a BEGIN
without one comes from a peer that predates it, whose rows were the dtype's first encoding. Nor is
a new model family: the layout's architecture names it, so KV never crosses families (a mismatch
names the architecture first); a BEGIN without one comes from a peer that ran Llama only.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from functools import partial
from types import ModuleType
from typing import TYPE_CHECKING, Any

import msgpack
import torch
import xxhash

from pdserve.engine import cpu_kernels
from pdserve.engine.config import KV_DTYPE_TABLE
from pdserve.engine.kv_format import KV_FORMATS, TORCH_DTYPES
from pdserve.transfer.frames import DEFAULT_MAX_CHUNK_BYTES
from pdserve.transfer.kvchunk import PackedFrame, message_prefix
from pdserve.units import ceil_div

if TYPE_CHECKING:
    from pdserve.engine.device_streams import Event
    from pdserve.transfer.staging import StagedCopies

WIRE_VERSION = 2  # 2: BEGIN carries the request's cache_salt

_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
_U64 = 1 << 64
_CHECKSUM_SLOT_BYTES = 9  # a checksum packed as msgpack uint 64: 0xcf, then 8 bytes big-endian


class WireError(ValueError):
    """A frame or layout that this receiver must not use."""


class ChecksumError(WireError):
    """A block's bytes do not match the checksum its sender computed."""

    def __init__(self, message: str, *, layer: int, position: int) -> None:
        super().__init__(message)
        self.layer = layer
        self.position = position


class FrameKind(StrEnum):
    BEGIN = "begin"
    LAYER = "layer"
    END = "end"


def block_checksum(data: bytes | memoryview) -> int:
    """The per-block checksum of wire version 1."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class KVLayout:
    """What the bytes of a KV block mean; sender and receiver must agree on all of it."""

    model_fingerprint: str
    block_size: int
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    row_format: str | None = None  # None: this process's encoding of kv_dtype
    wire_version: int = WIRE_VERSION
    architecture: str = "llama"  # the model family (pdserve/engine/families.py) that computed the KV

    def __post_init__(self) -> None:
        if self.kv_dtype not in TORCH_DTYPES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} is not one of {', '.join(TORCH_DTYPES)}")
        if self.row_format is None:
            object.__setattr__(self, "row_format", KV_DTYPE_TABLE[self.kv_dtype].row_format)
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.kv_dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """One block of one layer on the wire: (K|V, offset, kv_head, row); a row is head_dim
        elements, and the scale's for int8/fp8."""
        return (2, self.block_size, self.num_kv_heads, KV_FORMATS[self.kv_dtype].row_width(self.head_dim))

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V of one block of one layer, scales included."""
        return math.prod(self.block_shape) * self.torch_dtype.itemsize

    def first_mismatch(self, other: KVLayout) -> str | None:
        """Name the first field where `self`, the sender's layout as sent in BEGIN, differs from
        `other`, the receiver's; None when they agree. The architecture comes first: another family
        also has another fingerprint (and often other shapes), and the family is the reason;
        the other fields in declaration order."""
        for name in sorted((f.name for f in fields(self)), key=lambda name: name != "architecture"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name}: sender {_short(mine)}, receiver {_short(theirs)}"
        return None

    def to_msgpack_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> KVLayout:
        r = _Reader("layout", d)
        kwargs: dict[str, Any] = {"model_fingerprint": r.as_str("model_fingerprint"),
                                  "kv_dtype": r.as_str("kv_dtype")}
        # NOTE: a peer from before row formats sends none: its rows were the dtype's first
        # encoding, named as the dtype (an int8 one then differs from this int8: fail closed).
        kwargs["row_format"] = r.as_str("row_format") if "row_format" in d else kwargs["kv_dtype"]
        # NOTE: a peer from before families sends no architecture: it could run Llama's forward pass
        # only, so read it as llama. That alone never lets KV cross families: its model_fingerprint
        # (which hashes the whole ModelConfig, family included) must still equal the receiver's.
        kwargs["architecture"] = r.as_str("architecture") if "architecture" in d else "llama"
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "wire_version"):
            kwargs[name] = r.as_int(name)
        return _build(cls, "layout", **kwargs)

    @classmethod
    def of_cache(cls, kv_cache: torch.Tensor, model_fingerprint: str,
                 architecture: str = "llama") -> KVLayout:
        """The layout of an engine pool kv[layer, K|V, block, offset, kv_head, row], computed by a
        model of that fingerprint and family."""
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(f"expected a KV pool [layers, 2, blocks, block_size, kv_heads, row], "
                             f"got shape {tuple(kv_cache.shape)}")
        if kv_cache.dtype not in _DTYPE_NAMES:
            raise ValueError(f"KV pool dtype {kv_cache.dtype} has no wire name; "
                             f"use one of {', '.join(TORCH_DTYPES)}")
        layers, _, _, block_size, kv_heads, row = kv_cache.shape
        name = _DTYPE_NAMES[kv_cache.dtype]
        return cls(model_fingerprint, block_size, name, layers, kv_heads, KV_FORMATS[name].head_dim(row),
                   architecture=architecture)


@dataclass(frozen=True)
class TransferBegin:
    """First frame. `positions` are the sequence block indices the LAYER frames will carry
    (every one of them, for every layer); the receiver already holds the first
    `decode_cached_blocks` blocks. `num_tokens` tokens have KV (the prompt length)."""

    transfer_id: str
    request_id: str
    layout: KVLayout
    prompt_token_ids: tuple[int, ...]
    num_tokens: int
    decode_cached_blocks: int
    positions: tuple[int, ...]
    first_token: int | None = None
    cache_salt: bytes = b""  # the request's own prefix-cache salt: the receiver hashes the prompt with it

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        object.__setattr__(self, "positions", tuple(self.positions))
        n_blocks = ceil_div(self.num_tokens, self.layout.block_size)
        if self.num_tokens < 0 or self.decode_cached_blocks < 0:
            raise WireError(f"begin: negative count (num_tokens {self.num_tokens}, "
                            f"decode_cached_blocks {self.decode_cached_blocks})")
        if len(set(self.positions)) != len(self.positions):
            raise WireError(f"begin: positions repeat: {list(self.positions)}")
        bad = [p for p in self.positions if not 0 <= p < n_blocks]
        if bad:
            raise WireError(f"begin: positions {bad} outside the {n_blocks} blocks of {self.num_tokens} "
                            f"tokens at block_size {self.layout.block_size}")

    def encode(self) -> bytes:
        return _pack(FrameKind.BEGIN, transfer_id=self.transfer_id, request_id=self.request_id,
                     layout=self.layout.to_msgpack_dict(), prompt_token_ids=list(self.prompt_token_ids),
                     num_tokens=self.num_tokens, decode_cached_blocks=self.decode_cached_blocks,
                     positions=list(self.positions), first_token=self.first_token, cache_salt=self.cache_salt)

    @classmethod
    def _decode(cls, r: _Reader) -> TransferBegin:
        return _build(cls, r.kind, transfer_id=r.as_str("transfer_id"), request_id=r.as_str("request_id"),
                      layout=KVLayout.from_dict(r.get("layout")),
                      prompt_token_ids=r.as_ints("prompt_token_ids"), num_tokens=r.as_int("num_tokens"),
                      decode_cached_blocks=r.as_int("decode_cached_blocks"),
                      positions=r.as_ints("positions"), first_token=r.optional_int("first_token"),
                      cache_salt=r.as_bytes("cache_salt"))


@dataclass(frozen=True)
class LayerChunkHeader:
    """Header of one LAYER frame: blocks `positions` of `layer`, payload `shape` in `dtype`."""

    transfer_id: str
    layer: int
    positions: tuple[int, ...]
    dtype: str
    shape: tuple[int, ...]
    checksums: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("positions", "shape", "checksums"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        n = len(self.positions)
        if self.dtype not in TORCH_DTYPES:
            raise WireError(f"layer {self.layer}: dtype {self.dtype!r} is not one of "
                            f"{', '.join(TORCH_DTYPES)}")
        if len(self.shape) != 5 or self.shape[0] != n or self.shape[1] != 2 or min(self.shape) < 1:
            raise WireError(f"layer {self.layer}: payload shape {list(self.shape)} is not "
                            f"[{n} blocks, 2, block_size, kv_heads, row]")
        if len(self.checksums) != n or any(not 0 <= c < _U64 for c in self.checksums):
            raise WireError(f"layer {self.layer}: need {n} checksums in [0, 2**64), "
                            f"got {list(self.checksums)}")
        if self.layer < 0 or min(self.positions) < 0:
            raise WireError(f"layer {self.layer}: negative layer or position in {list(self.positions)}")

    @property
    def payload_nbytes(self) -> int:
        return math.prod(self.shape) * TORCH_DTYPES[self.dtype].itemsize

    def encode(self) -> bytes:
        return _pack(FrameKind.LAYER, transfer_id=self.transfer_id, layer=self.layer,
                     positions=list(self.positions), dtype=self.dtype, shape=list(self.shape),
                     checksums=list(self.checksums))

    @classmethod
    def _decode(cls, r: _Reader) -> LayerChunkHeader:
        return _build(cls, r.kind, transfer_id=r.as_str("transfer_id"), layer=r.as_int("layer"),
                      positions=r.as_ints("positions"), dtype=r.as_str("dtype"), shape=r.as_ints("shape"),
                      checksums=r.as_ints("checksums"))


@dataclass(frozen=True)
class TransferEnd:
    """Last frame. `total_blocks` counts (layer, block) pairs over all LAYER frames
    (num_layers x len(BEGIN.positions) when complete); `total_bytes` sums their payloads."""

    transfer_id: str
    total_blocks: int
    total_bytes: int

    def __post_init__(self) -> None:
        if self.total_blocks < 0 or self.total_bytes < 0:
            raise WireError(f"end: negative totals ({self.total_blocks} blocks, {self.total_bytes} bytes)")

    def encode(self) -> bytes:
        return _pack(FrameKind.END, transfer_id=self.transfer_id, total_blocks=self.total_blocks,
                     total_bytes=self.total_bytes)

    @classmethod
    def _decode(cls, r: _Reader) -> TransferEnd:
        return _build(cls, r.kind, transfer_id=r.as_str("transfer_id"), total_blocks=r.as_int("total_blocks"),
                      total_bytes=r.as_int("total_bytes"))


Frame = TransferBegin | LayerChunkHeader | TransferEnd
_DECODERS = {FrameKind.BEGIN: TransferBegin._decode, FrameKind.LAYER: LayerChunkHeader._decode,
             FrameKind.END: TransferEnd._decode}


def decode_header(data: bytes | memoryview) -> Frame:
    """Parse and validate one header; WireError on anything malformed or of another version."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise WireError(f"header is not valid msgpack ({type(e).__name__}: {e})") from e
    r = _Reader("header", obj)
    version = r.as_int("v")
    if version != WIRE_VERSION:
        raise WireError(f"sender speaks KV wire version {version}, this receiver speaks {WIRE_VERSION}; "
                        "run the same pdserve version on prefill and decode workers")
    kind = r.as_str("kind")
    if kind not in _DECODERS:
        raise WireError(f"header kind {kind!r} is not one of {', '.join(_DECODERS)}")
    return _DECODERS[FrameKind(kind)](_Reader(kind, obj))


def encode_layer(kv_cache: torch.Tensor, layer: int, block_ids: Sequence[int], positions: Sequence[int],
                 transfer_id: str, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, native: bool = True,
                 staged: StagedCopies | None = None, after: Event | None = None,
                 ) -> Iterator[tuple[bytes | memoryview, memoryview]]:
    """Yield (header, payload) LAYER frames carrying pool blocks `block_ids` of `layer` as
    sequence blocks `positions`, as many whole blocks per frame as fit in max_chunk_bytes
    (at least one).

    Two paths, the same frames. On a CPU pool where pdserve's CPU kernels run (and `native`),
    kv_blocks.cpp builds each frame's KVChunk message in one pass, blocks hashed as they are
    copied, and the frame is a PackedFrame (pdserve/transfer/kvchunk.py) of views into it.
    Otherwise (a device pool, no kernels, or native=False) the blocks are gathered into a
    staging buffer and hashed there, and the payload is a read-only view of that buffer, which
    the next frame's gather overwrites: use or copy it (serialise it, write it) before pulling
    the next frame. On that path a payload kept past that no longer matches its header's
    checksums, so a receiver rejects it (ChecksumError) rather than use it (tests/test_kvwire.py
    pins both paths).

    With `staged` (a device pool's, pdserve/transfer/staging.py), a third path, the same frames
    again: each chunk is gathered on the device and copied into a staging slot on staged's stream,
    after `after` (the event of the layer's compute), and hashed once that copy's event completes;
    the slot is released when the next frame is pulled or the generator is closed."""
    if len(block_ids) != len(positions):
        raise ValueError(f"{len(block_ids)} block ids but {len(positions)} positions")
    by_block = kv_cache[layer].transpose(0, 1)  # view: [num_blocks, 2, block_size, kv_heads, row]
    block_bytes = by_block[0].numel() * kv_cache.element_size()
    per_chunk = max(1, min(len(block_ids), max_chunk_bytes // block_bytes))
    if staged is not None:
        yield from _staged_frames(staged, after, by_block, layer, block_ids, positions, transfer_id,
                                  per_chunk)
        return
    packer = _kv_blocks(kv_cache[layer]) if native else None
    if packer is not None:
        yield from _packed_frames(packer, kv_cache, layer, block_ids, positions, transfer_id, per_chunk)
        return
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    # NOTE: one host staging buffer per call, reused by every chunk: the gather writes into
    # memory that is already mapped (a fresh 2 MiB tensor per chunk costs more in page faults
    # than the copy itself), and the payload is a view of it, not a copy: the channel's
    # serialiser copies it once, into the message (on 2 shared cores every pass over the bytes
    # costs throughput; `python -m bench.kv_transfer_wire` times it).
    with torch.inference_mode():  # the engine may call this inside inference mode, or not
        staging = torch.empty((per_chunk, *by_block.shape[1:]), dtype=kv_cache.dtype)
    for start in range(0, len(block_ids), per_chunk):
        idx = ids[start:start + per_chunk]
        blocks = _gather(by_block, idx, staging[:len(idx)])
        yield _encode_chunk(blocks, layer, positions[start:start + per_chunk], transfer_id)


def kv_blocks_path(kv_cache: torch.Tensor) -> str:
    """The path encode_layer and receive_layer take for this pool in a worker: "native" (kv_blocks.cpp),
    "python", or "staged" (a device pool: the sender and receiver pass their staging). It loads
    pdserve's CPU kernels (on a fresh machine, builds them, about a minute), so a worker calls it as it
    starts, not inside its first transfer's deadline."""
    if kv_cache.device.type != "cpu":
        return "staged"
    return "native" if _kv_blocks(kv_cache[0]) is not None else "python"


def _kv_blocks(pool_layer: torch.Tensor) -> ModuleType | None:
    """kv_blocks.cpp where it can serve this pool layer: on the CPU, contiguous, kernels built."""
    if pool_layer.device.type != "cpu" or not pool_layer.is_contiguous():
        return None
    return cpu_kernels.kv_blocks()


def _packed_frames(packer: ModuleType, kv_cache: torch.Tensor, layer: int, block_ids: Sequence[int],
                   positions: Sequence[int], transfer_id: str, per_chunk: int) -> Iterator[PackedFrame]:
    """The frames as whole KVChunk messages, each made by one pack_layer_frame call."""
    pool = kv_cache[layer]  # [2, num_blocks, block_size, kv_heads, row]
    block_shape, block_bytes = (2, *pool.shape[2:]), pool[:, 0].numel() * pool.element_size()
    dtype = _DTYPE_NAMES[pool.dtype]
    for start in range(0, len(block_ids), per_chunk):
        ids, chunk = list(block_ids[start:start + per_chunk]), tuple(positions[start:start + per_chunk])
        # NOTE: checksums are the header's last field; _U64 - 1 packs as msgpack uint 64 (0xcf and 8 bytes),
        # the placeholder kv_blocks.cpp fills in as it hashes each block (it refuses a slot without 0xcf).
        header = LayerChunkHeader(transfer_id, layer, chunk, dtype, (len(ids), *block_shape),
                                  (_U64 - 1,) * len(ids)).encode()
        prefix, header_end = message_prefix(header, len(ids) * block_bytes)
        first_slot = header_end - _CHECKSUM_SLOT_BYTES * len(ids) + 1  # each slot's 8 bytes, past its 0xcf
        yield PackedFrame(packer.pack_layer_frame(pool, ids, prefix, first_slot))


@torch.inference_mode()
def _gather(by_block: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if by_block.device == out.device:
        return torch.index_select(by_block, 0, idx, out=out)  # the one gather, contiguous
    return out.copy_(by_block.index_select(0, idx))  # device pool: gather there, then one D2H copy


def _staged_frames(staged: StagedCopies, after: Event | None, by_block: torch.Tensor, layer: int,
                   block_ids: Sequence[int], positions: Sequence[int], transfer_id: str,
                   per_chunk: int) -> Iterator[tuple[bytes, memoryview]]:
    """encode_layer's frames through staged's ring: one slot per frame, held until it is consumed."""
    if after is not None:
        staged.stream.wait_event(after)  # NOTE: the transfer stream, not this thread, waits for compute
    for start in range(0, len(block_ids), per_chunk):
        ids = list(block_ids[start:start + per_chunk])
        with staged.slot(transfer_id) as slot:
            host = slot.view(by_block.dtype, (len(ids), *by_block.shape[1:]))
            staged.stream.submit(partial(_gather_to_host, by_block, ids, host))
            copied = staged.record()
            staged.ring.fence(slot, copied)
            copied.synchronize()  # this thread hashes the bytes next: they must have landed
            yield _encode_chunk(host, layer, positions[start:start + per_chunk], transfer_id)


@torch.inference_mode()
def _gather_to_host(by_block: torch.Tensor, block_ids: list[int], out: torch.Tensor) -> None:
    """Run on a stream: blocks block_ids of one pool layer into host tensor `out`."""
    idx = torch.tensor(block_ids, dtype=torch.long).to(by_block.device, non_blocking=True)
    if by_block.device == out.device:
        torch.index_select(by_block, 0, idx, out=out)
    else:
        out.copy_(by_block.index_select(0, idx), non_blocking=True)


def _encode_chunk(blocks: torch.Tensor, layer: int, positions: Sequence[int],
                  transfer_id: str) -> tuple[bytes, memoryview]:
    # NOTE: blocks are always host memory here (the staging buffer or a staging slot); bfloat16 has no
    # numpy dtype, hence uint8.
    raw = memoryview(_host(blocks).view(torch.uint8).reshape(-1).numpy()).toreadonly()
    block_bytes = len(raw) // len(positions)
    sums = [block_checksum(raw[i * block_bytes:(i + 1) * block_bytes]) for i in range(len(positions))]
    header = LayerChunkHeader(transfer_id, layer, tuple(positions), _DTYPE_NAMES[blocks.dtype],
                              tuple(blocks.shape), tuple(sums))
    return header.encode(), raw


def receive_layer(kv_cache: torch.Tensor, header: LayerChunkHeader, payload: bytes | memoryview,
                  layout: KVLayout, block_ids: Sequence[int], native: bool = True,
                  staged: StagedCopies | None = None) -> None:
    """Verify a LAYER frame and copy its blocks into pool blocks `block_ids` of its layer.

    On a CPU pool where pdserve's CPU kernels run (and `native`), kv_blocks.cpp hashes each
    block and copies it while it is in cache: a block that fails its checksum raises
    ChecksumError and is not written, nor is any block after it, while the blocks before it
    (verified) are. Otherwise decode_layer verifies them all, then write_layer copies them.
    Either way a bad frame raises before its bad block reaches the pool, and the caller frees
    the transfer's reservation (decode_worker/receiver.py), so no unverified byte is used.

    With `staged` (a device pool's, pdserve/transfer/staging.py): decode_layer verifies the frame on
    the host, its blocks are copied into staging slots, and each slot is copied into the pool on
    staged's stream without waiting; the caller waits for that stream (an event recorded after the
    transfer's last frame) before the blocks are used."""
    raw = _checked_payload(header, payload, layout)
    if staged is not None:
        _load_staged(staged, kv_cache, header, decode_layer(header, raw, layout), block_ids)
        return
    packer = _kv_blocks(kv_cache[header.layer]) if native else None
    if packer is None:
        write_layer(kv_cache, header.layer, block_ids, decode_layer(header, raw, layout))
        return
    if len(block_ids) != len(header.positions) or len(set(block_ids)) != len(block_ids):
        raise ValueError(f"need {len(header.positions)} distinct block ids, got {list(block_ids)}")
    bad = packer.verify_write_layer(raw, list(header.checksums), kv_cache[header.layer], list(block_ids))
    if bad >= 0:
        raise _checksum_error(header, bad)


def _load_staged(staged: StagedCopies, kv_cache: torch.Tensor, header: LayerChunkHeader,
                 blocks: torch.Tensor, block_ids: Sequence[int]) -> None:
    """Verified host blocks into pool blocks block_ids of the header's layer, through staged's ring:
    as many blocks per slot as fit, each slot free again once its copy has run."""
    _check_blocks(kv_cache, header.layer, block_ids, blocks)
    per_slot = max(1, staged.ring.slot_bytes // max(1, blocks[0].numel() * blocks.element_size()))
    for start in range(0, len(block_ids), per_slot):
        part = blocks[start:start + per_slot]
        with staged.slot(header.transfer_id) as slot:
            host = slot.view(part.dtype, tuple(part.shape))
            host.copy_(part)  # NOTE: from gRPC's pageable bytes into the pinned slot, on this thread
            ids = list(block_ids[start:start + per_slot])
            staged.stream.submit(partial(_load_from_host, kv_cache[header.layer], ids, host))
            staged.ring.fence(slot, staged.record())


@torch.inference_mode()  # legal on pools made inside inference mode and outside it
def _load_from_host(pool: torch.Tensor, block_ids: list[int], host: torch.Tensor) -> None:
    """Run on a stream: host blocks [n, 2, ...] into pool layer [2, num_blocks, ...] at block_ids."""
    idx = torch.tensor(block_ids, dtype=torch.long).to(pool.device, non_blocking=True)
    pool.index_copy_(1, idx, host.to(pool.device, non_blocking=True).transpose(0, 1))


def decode_layer(header: LayerChunkHeader, payload: bytes | memoryview, layout: KVLayout) -> torch.Tensor:
    """Verify a LAYER frame against the receiver's layout and its checksums; return its blocks
    as a zero-copy [n, 2, block_size, kv_heads, row] view of `payload` (read-only when
    payload is bytes: copy it out with write_layer, never write into it)."""
    raw = _checked_payload(header, payload, layout)
    bb = layout.block_bytes
    for i, expected in enumerate(header.checksums):
        if block_checksum(raw[i * bb:(i + 1) * bb]) != expected:
            raise _checksum_error(header, i)
    with warnings.catch_warnings():
        # NOTE: torch warns (once) that a bytes buffer is not writable; the view is only read.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(raw, dtype=layout.torch_dtype)
    return flat.view(header.shape)


def _checked_payload(header: LayerChunkHeader, payload: bytes | memoryview, layout: KVLayout) -> memoryview:
    _check_against_layout(header, layout)
    raw = memoryview(payload).cast("B")
    if raw.nbytes != header.payload_nbytes:
        raise WireError(f"transfer {header.transfer_id} layer {header.layer}: payload has {raw.nbytes} "
                        f"bytes, shape {list(header.shape)} {header.dtype} needs {header.payload_nbytes} "
                        "(truncated or corrupt frame)")
    return raw


def _checksum_error(header: LayerChunkHeader, index: int) -> ChecksumError:
    position = header.positions[index]
    return ChecksumError(f"transfer {header.transfer_id}: checksum mismatch in layer {header.layer}, "
                         f"block position {position}; the block is corrupt and must be recomputed",
                         layer=header.layer, position=position)


def _check_against_layout(header: LayerChunkHeader, layout: KVLayout) -> None:
    where = f"transfer {header.transfer_id} layer {header.layer}"
    if header.layer >= layout.num_layers:
        raise WireError(f"{where}: the receiver's model has {layout.num_layers} layers")
    if header.dtype != layout.kv_dtype:
        raise WireError(f"{where}: dtype {header.dtype}, the receiver's pool holds {layout.kv_dtype}")
    if tuple(header.shape[1:]) != layout.block_shape:
        raise WireError(f"{where}: block shape {list(header.shape[1:])}, the receiver's is "
                        f"{list(layout.block_shape)}")


def write_layer(kv_cache: torch.Tensor, layer: int, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
    """Copy `blocks` [n, 2, block_size, kv_heads, row] into pool blocks `block_ids` of `layer`."""
    pool = kv_cache[layer]  # [2, num_blocks, block_size, kv_heads, row]
    _check_blocks(kv_cache, layer, block_ids, blocks)
    if pool.device.type != "cpu":
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=pool.device)
        with torch.inference_mode():  # legal on pools made inside inference mode and outside it
            pool.index_copy_(1, ids, blocks.transpose(0, 1).to(pool.device))
        return
    # NOTE: numpy, not index_copy_, on CPU: torch splits a copy this size across its intra-op
    # threads, and on a small VM the OpenMP hand-off costs milliseconds per chunk (0.2 GB/s
    # measured on 2 vCPUs); numpy copies on the calling thread at memory speed.
    dst = pool.view(torch.uint8).numpy()  # shares the pool's memory; uint8 because of bfloat16
    dst[:, list(block_ids)] = _host(blocks).contiguous().view(torch.uint8).numpy().swapaxes(0, 1)


def _check_blocks(kv_cache: torch.Tensor, layer: int, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
    expected = (len(block_ids), 2, *kv_cache.shape[3:])
    if tuple(blocks.shape) != expected or blocks.dtype != kv_cache.dtype:
        raise ValueError(f"blocks are {list(blocks.shape)} {blocks.dtype}; pool layer {layer} needs "
                         f"{list(expected)} {kv_cache.dtype}")
    if len(set(block_ids)) != len(block_ids):
        raise ValueError(f"block ids repeat: {list(block_ids)}")


def _host(t: torch.Tensor) -> torch.Tensor:
    """t itself when it is in host memory (no copy), else a host copy: numpy() needs host memory."""
    return t if t.device.type == "cpu" else t.cpu()


def _pack(kind: FrameKind, **body: Any) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, "kind": kind.value, **body}, use_bin_type=True)


def _build(cls: type, kind: str, **kwargs: Any) -> Any:
    try:
        return cls(**kwargs)
    except WireError:
        raise
    except ValueError as e:
        raise WireError(f"{kind}: {e}") from e


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 16 else text[:12] + "…"


@dataclass(frozen=True)
class _Reader:
    """Typed field access to a decoded msgpack map, raising WireError that names the field."""

    kind: str
    obj: Any

    def get(self, key: str) -> Any:
        if not isinstance(self.obj, dict):
            raise WireError(f"{self.kind} is a {type(self.obj).__name__}, expected a msgpack map")
        if key not in self.obj:
            raise WireError(f"{self.kind}: field {key!r} is missing")
        return self.obj[key]

    def as_int(self, key: str) -> int:
        value = self.get(key)
        if not _is_int(value):
            raise WireError(f"{self.kind}: field {key!r} must be an int, got {_show(value)}")
        return value

    def optional_int(self, key: str) -> int | None:
        return None if isinstance(self.obj, dict) and self.obj.get(key) is None else self.as_int(key)

    def as_str(self, key: str) -> str:
        value = self.get(key)
        if not isinstance(value, str):
            raise WireError(f"{self.kind}: field {key!r} must be a str, got {_show(value)}")
        return value

    def as_bytes(self, key: str) -> bytes:
        value = self.get(key)
        if not isinstance(value, bytes):
            raise WireError(f"{self.kind}: field {key!r} must be bytes, got {_show(value)}")
        return value

    def as_ints(self, key: str) -> tuple[int, ...]:
        value = self.get(key)
        if not isinstance(value, list) or not all(_is_int(v) for v in value):
            raise WireError(f"{self.kind}: field {key!r} must be a list of ints, got {_show(value)}")
        return tuple(value)


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.60}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
