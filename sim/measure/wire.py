"""The KV transfer rate `pdserve sim calibrate` prices: a pool pushed through production's gRPC path.

    push_seconds   this process holds a synthetic pool kv[layer, K|V, block, ...] of N MiB and pushes
                   every block, as BEGIN, encode_layer chunks for every layer and END, through
                   production's GrpcKVChannel (prefill_worker/channels.py) to a receiver in a spawned
                   process (receiver_process), which checks and writes them into a zeroed pool of the
                   same layout (PoolReceiver: decode_header / receive_layer, as a decode worker does)
                   and answers after END. Timed from the first frame to the reply; the median of
                   `reps` after one warm-up.

The pieces (make_pool, PoolReceiver, add_pool_receiver, transfer_frames) are bench.kv_transfer_wire's
too: it times the same push against a raw TCP socket.

Not pure: it loads torch, grpc and the prefill worker's channel, which is why it is only imported when
a calibration runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import statistics
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from pdserve import kvwire
from pdserve.engine.kv_format import KV_FORMATS, TORCH_DTYPES
from pdserve.kvwire import KVLayout, TransferBegin, TransferEnd, WireError
from pdserve.transfer.kvchunk import parse_kv_chunk
from prefill_worker.channels import GrpcKVChannel
from protos.pdserve.v1 import kv_transfer_pb2 as pb

MIB = 1 << 20
SERVICE = "pdserve.v1.KVTransfer"
MAX_MESSAGE_BYTES = 16 * MIB  # far above any chunk; set on both ends, never left to defaults
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
FINGERPRINT = "bench-kv-transfer-wire"
PUSH_TIMEOUT_S = 600.0
RECEIVER_START_S = 120.0  # a spawned process imports torch and grpc before it serves
Frame = tuple[bytes, bytes]  # (msgpack header, payload)


def make_pool(mib: int, kv_dtype: str, layers: int = 32, block_size: int = 16, kv_heads: int = 8,
              head_dim: int = 128, fill: bool = True) -> torch.Tensor:
    """A pool kv[layers, 2, blocks, block_size, kv_heads, row] of `mib` MiB (random bytes, or
    zeros), blocks = mib MiB / (layers x block bytes); a Llama-3-8B-like head geometry."""
    dtype, row = TORCH_DTYPES[kv_dtype], KV_FORMATS[kv_dtype].row_width(head_dim)
    per_block = 2 * block_size * kv_heads * row * dtype.itemsize * layers
    if (mib * MIB) % per_block:
        raise ValueError(f"{mib} MiB is not a whole number of {per_block}-byte blocks")
    shape = (layers, 2, mib * MIB // per_block, block_size, kv_heads, row)
    if not fill:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.randint(0, 256, (mib * MIB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    return raw.view(dtype).view(shape)


def keep_freed_memory() -> bool:
    """Stop glibc handing freed multi-MiB buffers back to the kernel (True if it took).

    NOTE: every chunk allocates a few fresh 2 MiB buffers (payload bytes, the serialised
    message, gRPC's copies); with glibc's default thresholds many go back to the kernel when
    freed, and the next chunk page-faults them in again. Workers get the same through
    EngineConfig.retain_freed_memory (pdserve/engine/cpu_allocator.py).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False  # not glibc: nothing to tune
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 64 * MIB) and libc.mallopt(m_trim_threshold, 256 * MIB))


# -- receiver -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    transfer_id: str
    blocks_written: int  # (layer, block) pairs
    bytes_received: int


@dataclass(frozen=True)
class PoolReceiver:
    """Writes one transfer into a bare pool: sequence block position p lands in pool block p.

    Fails closed: any WireError stops the transfer at that frame (what was written stays
    unused: a bare pool has no reservation to free)."""

    kv_cache: torch.Tensor
    layout: KVLayout
    native: bool = True  # receive_layer's path: kv_blocks.cpp, or the Python one

    def receive(self, frames: Iterable[tuple[bytes | memoryview, bytes | memoryview]]) -> Received:
        it = iter(frames)
        begin = self._begin(next(it, None))
        written = received = 0
        for header, payload in it:
            frame = kvwire.decode_header(header)
            if isinstance(frame, TransferEnd):
                return self._end(begin, frame, written, received)
            if not isinstance(frame, kvwire.LayerChunkHeader) or frame.transfer_id != begin.transfer_id:
                raise WireError(f"transfer {begin.transfer_id}: unexpected frame {frame!r:.120}")
            kvwire.receive_layer(self.kv_cache, frame, payload, self.layout, frame.positions, self.native)
            written, received = written + len(frame.positions), received + len(payload)
        raise WireError(f"transfer {begin.transfer_id}: stream ended before END")

    def _begin(self, first: Any) -> TransferBegin:
        begin = kvwire.decode_header(first[0]) if first is not None else None
        if not isinstance(begin, TransferBegin):
            raise WireError(f"a transfer must open with BEGIN, got {begin!r:.120}")
        mismatch = begin.layout.first_mismatch(self.layout)
        if mismatch:
            raise WireError(f"transfer {begin.transfer_id}: KV layout mismatch, {mismatch}")
        if begin.positions and max(begin.positions) >= self.kv_cache.shape[2]:
            raise WireError(f"transfer {begin.transfer_id}: position {max(begin.positions)} beyond "
                            f"this pool's {self.kv_cache.shape[2]} blocks")
        return begin

    def _end(self, begin: TransferBegin, end: TransferEnd, written: int, received: int) -> Received:
        expected = self.layout.num_layers * len(begin.positions)
        if (end.total_blocks, end.total_bytes) != (written, received) or written != expected:
            raise WireError(f"transfer {begin.transfer_id}: END says {end.total_blocks} blocks / "
                            f"{end.total_bytes} bytes, got {written} / {received}, "
                            f"expected {expected} blocks")
        return Received(begin.transfer_id, written, received)


def add_pool_receiver(server: grpc.Server, receiver: PoolReceiver, codec: str = "raw") -> None:
    """Serve /pdserve.v1.KVTransfer/Push on `server` into `receiver`'s pool. codec raw reads KVChunk
    messages by hand, as production does (pdserve/transfer/kvchunk.py); proto with the generated stubs."""

    def push(requests: Iterator[Any], context: grpc.ServicerContext) -> pb.PushReply:
        frames = requests if codec == "raw" else ((m.header, m.payload) for m in requests)
        try:
            got = receiver.receive(frames)
        except kvwire.ChecksumError as e:
            context.abort(grpc.StatusCode.DATA_LOSS, str(e))
        except WireError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.PushReply(transfer_id=got.transfer_id, blocks_written=got.blocks_written,
                            bytes_received=got.bytes_received)

    deserialize = parse_kv_chunk if codec == "raw" else pb.KVChunk.FromString
    handler = grpc.stream_unary_rpc_method_handler(push, request_deserializer=deserialize,
                                                   response_serializer=pb.PushReply.SerializeToString)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {"Push": handler})])


def _serve_pool(mib: int, kv_dtype: str, ports: Any, stop: Any) -> None:
    """The receiver process: a zeroed pool behind gRPC on a free loopback port, until `stop` is set."""
    keep_freed_memory()
    pool = make_pool(mib, kv_dtype, fill=False)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
    add_pool_receiver(server, PoolReceiver(pool, KVLayout.of_cache(pool, FINGERPRINT)))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    stop.wait()
    server.stop(grace=None)


@contextlib.contextmanager
def receiver_process(mib: int, kv_dtype: str) -> Iterator[int]:
    """A spawned process serving a `mib` MiB pool (_serve_pool); yields its gRPC port."""
    ctx = multiprocessing.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_serve_pool, args=(mib, kv_dtype, ports, stop), daemon=True)
    child.start()
    try:
        yield ports.get(timeout=RECEIVER_START_S)
    finally:
        stop.set()
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
            child.join()


# -- sender ---------------------------------------------------------------------------------


def transfer_frames(kv_cache: torch.Tensor, layout: KVLayout, transfer_id: str, block_ids: Sequence[int],
                    positions: Sequence[int], max_chunk_bytes: int, native: bool = True) -> Iterator[Frame]:
    """BEGIN, every layer's blocks as encode_layer chunks (on its native or Python path), END."""
    num_tokens = (max(positions, default=-1) + 1) * layout.block_size
    begin = TransferBegin(transfer_id, transfer_id, layout, tuple(range(num_tokens)), num_tokens, 0,
                          tuple(positions))
    yield begin.encode(), b""
    total = 0
    for layer in range(layout.num_layers):
        for frame in kvwire.encode_layer(kv_cache, layer, block_ids, positions, transfer_id, max_chunk_bytes,
                                         native=native):
            total += len(frame[1])
            yield frame  # as it is: a PackedFrame is serialised without a copy
    yield TransferEnd(transfer_id, layout.num_layers * len(block_ids), total).encode(), b""


def push_seconds(mib: int, kv_dtype: str, reps: int, chunk_bytes: int) -> float:
    """Median seconds to push a `mib` MiB pool to another process (the module's docstring)."""
    pool = make_pool(mib, kv_dtype)
    layout = KVLayout.of_cache(pool, FINGERPRINT)
    num_blocks = pool.shape[2]
    block_ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    with receiver_process(mib, kv_dtype) as port:
        channel = GrpcKVChannel(f"127.0.0.1:{port}")
        try:
            def once() -> float:
                frames = transfer_frames(pool, layout, "calibrate", block_ids, range(num_blocks), chunk_bytes)
                start = time.perf_counter()
                written = channel.push(frames, PUSH_TIMEOUT_S).blocks_written
                if written != layout.num_layers * num_blocks:
                    raise RuntimeError(f"receiver wrote {written} blocks of {layout.num_layers * num_blocks}")
                return time.perf_counter() - start

            once()  # warm-up: the connection and the first buffers
            return statistics.median(once() for _ in range(reps))
        finally:
            channel.close()
