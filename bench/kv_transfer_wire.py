"""KV blocks through gRPC KVTransfer.Push against a raw TCP socket: two processes, one run.

    python -m bench.kv_transfer_wire [--json] [--sizes 64,512] [--dtype float16] [--reps 3]
                                     [--chunk-mib 4] [--codec raw|proto]
                                     [--chunk-sizes 64K,256K,1M,2M,4M,8M [--plot PNG]] [--floor]
                                     [--stages] [--kv-blocks native,python]

The sender is this process, holding a synthetic pool kv[layer, K|V, block, ...] of N MiB.
The receiver is a subprocess (`--serve`) holding a zeroed pool of the same layout; it
serves both peers on loopback:

  grpc  BEGIN, encode_layer chunks for every layer, END, streamed through Push; the receiver
        runs decode_header / receive_layer (checksums, the write into its pool) and answers
        after END. Timed from the first frame to the reply.
  tcp   the same payload bytes, chunk by chunk, through one socket into a preallocated
        buffer: no codec, no checksum, no gather. Timed from the first byte to a 1-byte ack.

Reported per size, medians over reps after one warm-up each, the two peers alternating rep by
rep: grpc_gbps and tcp_gbps (GB/s, 1e9 bytes), ratio = grpc / tcp, checksum_overhead =
the time to checksum the same bytes twice (sender and receiver) / the gRPC transfer time, and
{grpc,tcp}_{sender,receiver}_cpu_s_per_gb: CPU seconds each end spent per GB (CPUMeter).
--floor adds gRPC alone (measure_floor); --stages the push's own work without gRPC, stage by
stage, in s/GB (stage_*: measure_stages).
The headline keys on the JSON's last line are those of the largest size.

KV blocks paths (--kv-blocks; each a case of its own, against its own TCP reps):
  native  production's on a CPU pool where pdserve's CPU kernels build: kv_blocks.cpp makes each
          frame's message in one pass (copy and hash a block while it is in cache) and the
          receiver verifies and writes each block in one pass (pdserve/kvwire.py)
  python  the fallback (a device pool, or no kernels): a gather into a staging buffer, xxhash
          over it, a join into the message; on the receiver xxhash, then write_layer

Codecs (same method, same protobuf bytes on the wire, so either end may use either):
  proto  the generated stubs: KVChunk messages, SerializeToString / FromString
  raw    pdserve/transfer/kvchunk.py, what production uses: KVChunk's two length-delimited
         fields written and read by hand, one copy on the sender, zero-copy on the receiver

The pool, its receiver and the frames are sim/measure/wire.py's, which `pdserve sim calibrate` times alone;
bench/kv_transfer.py calls measure as it is.
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from bench import common
from pdserve.engine.kv_format import KV_FORMATS
from pdserve.kvwire import (
    KVLayout,
    LayerChunkHeader,
    block_checksum,
    decode_header,
    decode_layer,
)
from pdserve.transfer.frames import DEFAULT_MAX_CHUNK_BYTES
from pdserve.transfer.kvchunk import parse_kv_chunk, serialize_kv_chunk
from prefill_worker.channels import GrpcKVChannel
from protos.pdserve.v1 import kv_transfer_pb2 as pb
from protos.pdserve.v1 import kv_transfer_pb2_grpc as pb_grpc
from sim.measure.wire import (
    FINGERPRINT,
    GRPC_OPTIONS,
    MIB,
    PUSH_TIMEOUT_S,
    SERVICE,
    Frame,
    PoolReceiver,
    add_pool_receiver,
    keep_freed_memory,
    make_pool,
    transfer_frames,
)

PUSH_METHOD = f"/{SERVICE}/Push"
# NOTE: HTTP/2 tuning (bdp_probe off, 16 MiB frames, a 32 MiB stream window, bigger TCP reads)
# moved nothing beyond run-to-run noise on a 2-vCPU VM; try more with --grpc-arg.
DISCARD_METHOD = "/pdserve.bench.Discard/Push"  # --floor: gRPC with no codec on either end


def grpc_options(extra: Sequence[str] = ()) -> list[tuple[str, int | str]]:
    """GRPC_OPTIONS with KEY=VALUE overrides (values that look like ints become ints)."""
    parsed = [tuple(a.split("=", 1)) for a in extra]
    if any(len(p) != 2 for p in parsed):
        raise ValueError(f"--grpc-arg takes KEY=VALUE, got {list(extra)}")
    overrides = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in parsed}
    return list({**dict(GRPC_OPTIONS), **overrides}.items())


# -- receivers ----------------------------------------------------------------------------


def add_discarding_receiver(server: grpc.Server) -> None:
    """Serve DISCARD_METHOD: count the bytes of every message and drop them (gRPC alone)."""

    def push(requests: Iterator[bytes], context: grpc.ServicerContext) -> pb.PushReply:
        return pb.PushReply(bytes_received=sum(len(m) for m in requests))

    handler = grpc.stream_unary_rpc_method_handler(push, response_serializer=pb.PushReply.SerializeToString)
    service, _, method = DISCARD_METHOD.strip("/").partition("/")
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {method: handler})])


# -- sender ---------------------------------------------------------------------------------


def push_pool(channel: grpc.Channel, frames: Iterator[Frame], codec: str = "raw") -> pb.PushReply:
    if codec == "raw":
        push = channel.stream_unary(PUSH_METHOD, request_serializer=serialize_kv_chunk,
                                    response_deserializer=pb.PushReply.FromString)
        return push(frames)
    stub = pb_grpc.KVTransferStub(channel)
    return stub.Push(pb.KVChunk(header=bytes(h), payload=bytes(p)) for h, p in frames)  # it takes no views


# -- raw TCP peer ---------------------------------------------------------------------------
# Framing: an 8-byte little-endian length, the bytes, then a 1-byte ack from the receiver.


def serve_tcp(listener: socket.socket, capacity: int) -> None:
    """Accept connections forever; read each one's bytes into one preallocated buffer."""
    buffer = memoryview(bytearray(capacity))
    while True:
        conn, _ = listener.accept()
        with conn:
            (size,) = struct.unpack("<Q", _recv_exactly(conn, 8))
            if size > capacity:
                raise ValueError(f"tcp peer sent {size} bytes, the buffer holds {capacity}")
            got = 0
            while got < size:
                n = conn.recv_into(buffer[got:size])
                if n == 0:
                    raise ConnectionError(f"tcp peer closed after {got} of {size} bytes")
                got += n
            conn.sendall(b"\x01")


def send_tcp(port: int, chunks: Sequence[memoryview]) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(struct.pack("<Q", sum(c.nbytes for c in chunks)))
        for chunk in chunks:
            conn.sendall(chunk)
        if _recv_exactly(conn, 1) != b"\x01":
            raise ConnectionError("tcp peer did not ack")


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = conn.recv(n - len(data))
        if not more:
            raise ConnectionError(f"peer closed after {len(data)} of {n} bytes")
        data += more
    return data


def payload_chunks(kv_cache: torch.Tensor, chunk_bytes: int) -> list[memoryview]:
    """The pool's bytes, in place, cut into chunk_bytes pieces: what TCP sends."""
    flat = memoryview(kv_cache.view(torch.uint8).reshape(-1).numpy())
    return [flat[i:i + chunk_bytes] for i in range(0, len(flat), chunk_bytes)]


# -- the receiver process -------------------------------------------------------------------


def serve_main(args: argparse.Namespace) -> None:
    """Receiver: zeroed pool, gRPC and TCP servers on free loopback ports; runs until stdin closes."""
    keep_freed_memory()
    pool = make_pool(args.mib, args.dtype, fill=False)
    options = grpc_options(args.grpc_arg)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
    receiver = PoolReceiver(pool, KVLayout.of_cache(pool, FINGERPRINT), args.kv_blocks[0] == "native")
    add_pool_receiver(server, receiver, args.codec)
    add_discarding_receiver(server)
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=serve_tcp, args=(listener, args.mib * MIB), daemon=True).start()
    print(f"ports {grpc_port} {listener.getsockname()[1]}", flush=True)
    sys.stdin.read()  # the parent closes stdin when it is done
    server.stop(grace=None)


@dataclass
class ReceiverProcess:
    proc: subprocess.Popen
    grpc_port: int
    tcp_port: int

    @classmethod
    def start(cls, mib: int, kv_dtype: str, codec: str, grpc_args: Sequence[str] = (),
              native: bool = True) -> ReceiverProcess:
        proc = common.serving_child(["bench.kv_transfer_wire", "--serve", "--mib", str(mib), "--dtype",
                                     kv_dtype, "--codec", codec, *(f"--grpc-arg={a}" for a in grpc_args),
                                     "--kv-blocks", "native" if native else "python"])
        grpc_port, tcp_port = common.child_report(proc, "ports", "receiver process")
        return cls(proc, int(grpc_port), int(tcp_port))

    def stop(self) -> None:
        common.stop_child(self.proc, timeout_s=10)


# -- measurement ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    mib: int
    kv_dtype: str
    reps: int
    chunk_bytes: int
    codec: str
    grpc_args: tuple[str, ...] = ()
    floor: bool = False
    stages: bool = False
    native: bool = True  # --kv-blocks: kv_blocks.cpp on both ends, or the Python path


def measure(case: Case) -> dict[str, Any]:
    pool = make_pool(case.mib, case.kv_dtype)
    layout = KVLayout.of_cache(pool, FINGERPRINT)
    num_blocks = pool.shape[2]
    block_ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    chunks = payload_chunks(pool, max(1, case.chunk_bytes // layout.block_bytes) * layout.block_bytes)
    receiver = ReceiverProcess.start(case.mib, case.kv_dtype, case.codec, case.grpc_args, case.native)
    push = Pusher.open(f"127.0.0.1:{receiver.grpc_port}", case)
    try:
        def grpc_once() -> None:
            frames = transfer_frames(pool, layout, "bench", block_ids, range(num_blocks), case.chunk_bytes,
                                     case.native)
            written = push(frames)
            if written != layout.num_layers * num_blocks:
                raise RuntimeError(f"receiver wrote {written} blocks of {layout.num_layers * num_blocks}")

        cpu = CPUMeter(receiver.proc.pid)
        grpc_s, tcp_s = alternate(cpu.wrap("grpc", grpc_once),
                                  cpu.wrap("tcp", lambda: send_tcp(receiver.tcp_port, chunks)), case.reps)
        floor = measure_floor(f"127.0.0.1:{receiver.grpc_port}", pool, layout, block_ids, case, cpu) \
            if case.floor else {}
    finally:
        push.close()
        receiver.stop()
    checksum_s = common.median([common.timed(lambda: checksum_all(chunks, layout.block_bytes))[0]
                         for _ in range(case.reps)])
    stages = measure_stages(pool, layout, block_ids, case.chunk_bytes, case.reps,
                            torch.zeros_like(pool), case.native) if case.stages else {}
    nbytes = case.mib * MIB
    grpc_gbps, tcp_gbps = nbytes / grpc_s / 1e9, nbytes / tcp_s / 1e9
    return {"mib": case.mib, "kv_dtype": case.kv_dtype, "chunk_kib": case.chunk_bytes // 1024,
            "kv_blocks": "native" if case.native else "python",
            "grpc_gbps": grpc_gbps, "tcp_gbps": tcp_gbps,
            "ratio": common.ratio(grpc_gbps, tcp_gbps), "checksum_overhead": 2 * checksum_s / grpc_s,
            "grpc_s": grpc_s, "tcp_s": tcp_s, "checksum_s": checksum_s, **floor, **stages,
            **cpu.per_gb(nbytes)}


def measure_floor(target: str, pool: torch.Tensor, layout: KVLayout, block_ids: Sequence[int], case: Case,
                  cpu: CPUMeter) -> dict[str, float]:
    """gRPC Python's own cost: the same KVChunk messages, serialised before the clock starts,
    into a receiver that drops them (no gather, checksum, parse or write on either end)."""
    messages = [serialize_kv_chunk(f) for f in transfer_frames(pool, layout, "floor", block_ids,
                                                               range(len(block_ids)), case.chunk_bytes,
                                                               case.native)]
    with grpc.insecure_channel(target, options=grpc_options(case.grpc_args)) as channel:
        push = channel.stream_unary(DISCARD_METHOD, response_deserializer=pb.PushReply.FromString)
        once = cpu.wrap("floor", lambda: push(iter(messages), timeout=PUSH_TIMEOUT_S))
        once()
        floor_s = common.median([common.timed(once)[0] for _ in range(case.reps)])
    return {"floor_gbps": case.mib * MIB / floor_s / 1e9, "floor_s": floor_s}


def measure_stages(pool: torch.Tensor, layout: KVLayout, block_ids: Sequence[int], chunk_bytes: int,
                   reps: int, into: torch.Tensor, native: bool = True) -> dict[str, float]:
    """The push's own work without gRPC, in this process (on one torch thread under main()),
    seconds per GB (medians of `reps` after a warm-up), through production's pieces, on the
    native or the Python path of encode_layer and receive_layer:

      stage_encode            transfer_frames: encode_layer's frames (native: whole messages, the
                              blocks hashed as they are copied; python: a gather and checksums)
      stage_encode_serialize  the same, each frame then made a KVChunk message (serialize_kv_chunk:
                              native, the message itself; python, a join)
      stage_verify            each message parsed (parse_kv_chunk, decode_header) and its blocks'
                              checksums verified (decode_layer, xxhash on either path)
      stage_verify_write      PoolReceiver.receive of the parsed messages: receive_layer into `into`
                              (a pool of the same layout, which ends equal to `pool`)"""
    def frames() -> Iterator[Frame]:
        return transfer_frames(pool, layout, "stages", block_ids, range(len(block_ids)), chunk_bytes, native)

    messages = [serialize_kv_chunk(f) for f in frames()]

    def verify() -> None:
        for header, payload in map(parse_kv_chunk, messages):
            frame = decode_header(header)
            if isinstance(frame, LayerChunkHeader):
                decode_layer(frame, payload, layout)

    receiver = PoolReceiver(into, layout, native)
    stages = {"encode": lambda: deque(frames(), maxlen=0),
              "encode_serialize": lambda: deque(map(serialize_kv_chunk, frames()), maxlen=0),
              "verify": verify,
              "verify_write": lambda: receiver.receive(map(parse_kv_chunk, messages))}
    gb = pool.numel() * pool.element_size() / 1e9
    out = {}
    for name, fn in stages.items():
        fn()
        out[f"stage_{name}_s_per_gb"] = common.median([common.timed(fn)[0] for _ in range(reps)]) / gb
    return out


class CPUMeter:
    """CPU seconds each end spent per timed run: this process (the sender, all its threads) and
    the receiver process (from /proc; Linux only, else nothing is reported).

    NOTE: on a machine shared with other work, wall-clock GB/s swings with the load (TCP
    itself moved 1.3-3.4 GB/s between runs on 2 busy vCPUs); CPU seconds per GB moved far
    less, so they are what shows a change in either end's own cost."""

    def __init__(self, receiver_pid: int) -> None:
        self.stat = Path(f"/proc/{receiver_pid}/stat")
        self.available = self.stat.exists()
        self.samples: dict[str, list[tuple[float, float]]] = {}

    def wrap(self, name: str, fn: Callable[[], None]) -> Callable[[], None]:
        def measured() -> None:
            sender, receiver = _own_cpu_s(), self._receiver_cpu_s()
            fn()
            spent = (_own_cpu_s() - sender, self._receiver_cpu_s() - receiver)
            self.samples.setdefault(name, []).append(spent)
        return measured

    def per_gb(self, nbytes: int) -> dict[str, float]:
        """{peer}_{end}_cpu_s_per_gb, medians over the runs (warm-up included)."""
        if not self.available:
            return {}
        gb = nbytes / 1e9
        return {f"{name}_{end}_cpu_s_per_gb": common.median([s[i] for s in runs]) / gb
                for name, runs in self.samples.items() for i, end in enumerate(("sender", "receiver"))}

    def _receiver_cpu_s(self) -> float:
        if not self.available:
            return 0.0
        fields = self.stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class Pusher:
    """Pushes one transfer's frames; returns the blocks the receiver wrote.

    raw: production's own GrpcKVChannel (prefill_worker/channels.py: hand-written KVChunk,
    frames made ahead on this thread, production's channel options; --grpc-arg reaches only
    the receiver). proto: the generated stub on a plain channel with GRPC_OPTIONS + --grpc-arg."""

    push: Callable[[Iterator[Frame]], int]
    close: Callable[[], None]

    @classmethod
    def open(cls, target: str, case: Case) -> Pusher:
        if case.codec == "raw":
            kv_channel = GrpcKVChannel(target)
            return cls(lambda frames: kv_channel.push(frames, PUSH_TIMEOUT_S).blocks_written,
                       kv_channel.close)
        channel = grpc.insecure_channel(target, options=grpc_options(case.grpc_args))
        return cls(lambda frames: push_pool(channel, frames, "proto").blocks_written, channel.close)

    def __call__(self, frames: Iterator[Frame]) -> int:
        return self.push(frames)


def alternate(a: Callable[[], None], b: Callable[[], None], reps: int) -> tuple[float, float]:
    """Median seconds of a and of b, after one warm-up each, alternating rep by rep."""
    a(), b()
    times = [(common.timed(a)[0], common.timed(b)[0]) for _ in range(reps)]
    return common.median([t for t, _ in times]), common.median([t for _, t in times])


def checksum_all(chunks: Sequence[memoryview], block_bytes: int) -> None:
    for chunk in chunks:
        for start in range(0, chunk.nbytes, block_bytes):
            block_checksum(chunk[start:start + block_bytes])


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.serve:
        return serve_main(args)
    torch.set_num_threads(1)  # the copies here are memory-bound; intra-op threads only contend
    keep_freed_memory()
    default_chunk = int(args.chunk_mib * MIB)
    sweep = args.chunk_sizes or [default_chunk]
    sizes = [max(args.sizes)] if args.chunk_sizes else args.sizes
    cases = [Case(mib, args.dtype, args.reps, chunk, args.codec, tuple(args.grpc_arg), args.floor,
                  args.stages, path == "native")
             for path in args.kv_blocks for mib in sizes for chunk in sweep]
    rows = []
    for case in cases:
        path = "native" if case.native else "python"
        common.progress(f"{case.mib} MiB {case.kv_dtype}, chunk {case.chunk_bytes // 1024} KiB, "
                        f"{case.reps} reps, codec {case.codec}, kv blocks {path}")
        rows.append(measure(case))
    headline = next((r for r in rows if r["chunk_kib"] * 1024 == default_chunk and r["mib"] == max(sizes)
                     and r["kv_blocks"] == args.kv_blocks[0]), rows[-1])
    keys = ("mib", "kv_dtype", "chunk_kib", "kv_blocks", "grpc_gbps", "tcp_gbps", "ratio",
            "checksum_overhead",
            *(["floor_gbps"] if args.floor else []),
            *(k for k in rows[0] if k.startswith("stage_")),
            *(k for k in rows[0] if k.endswith("_cpu_s_per_gb")))
    table = common.format_table(keys, [[r[k] for k in keys] for r in rows])
    result = {**{k: headline[k] for k in ("grpc_gbps", "tcp_gbps", "ratio", "checksum_overhead")},
              "unit": "GB/s", "codec": args.codec,
              "kv_blocks": headline["kv_blocks"], "chunk_mib": headline["chunk_kib"] / 1024, "cases": rows,
              "environment": common.environment(torch.get_num_threads())}
    if args.chunk_sizes:
        result["chunk_curve_png"] = plot_chunk_curve(rows, args.plot)
    common.publish(table, result, args.json)


def plot_chunk_curve(rows: Sequence[dict[str, Any]], path: str) -> str:
    """gRPC and TCP GB/s against frame size, as a PNG at `path`; returns the path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kib = [r["chunk_kib"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(kib, [r["grpc_gbps"] for r in rows], "o-", label="gRPC KVTransfer.Push")
    ax.plot(kib, [r["tcp_gbps"] for r in rows], "s--", label="raw TCP, same chunks")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max_chunk_bytes (KiB)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"{rows[0]['mib']} MiB {rows[0]['kv_dtype']} KV over loopback")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def parse_bytes(text: str) -> int:
    """'64K', '2M', '1.5M' or a plain byte count -> bytes."""
    units = {"K": 1 << 10, "M": MIB}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def parse_paths(text: str) -> list[str]:
    paths = [p.strip() for p in text.split(",")]
    unknown = [p for p in paths if p not in ("native", "python")]
    if unknown or not paths:
        raise argparse.ArgumentTypeError(f"--kv-blocks takes native and/or python, got {text!r}")
    return paths


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = common.bench_parser("python -m bench.kv_transfer_wire", __doc__)
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[64, 512],
                   help="MiB of KV per transfer, comma-separated (default 64,512)")
    # NOTE: the float dtypes only: an int8/fp8 row (head_dim + 4 bytes) makes no whole number of
    # blocks in a power-of-two MiB, and the wire moves bytes alike whatever they mean.
    p.add_argument("--dtype", choices=[n for n, f in KV_FORMATS.items() if not f.scale_elements],
                   default="float16", help="element type of the synthetic KV pool (default: %(default)s)")
    p.add_argument("--reps", type=int, default=3, help="timed transfers per size and peer; the median is "
                                                       "reported (default: %(default)s)")
    p.add_argument("--chunk-mib", type=float, default=DEFAULT_MAX_CHUNK_BYTES / MIB,
                   help="max_chunk_bytes of encode_layer, in MiB (default: production's, %(default)g)")
    p.add_argument("--chunk-sizes", type=lambda s: [parse_bytes(x) for x in s.split(",")], default=None,
                   metavar="64K,256K,...", help="sweep max_chunk_bytes at the largest --sizes and print the "
                                               "curve (e.g. 64K,256K,1M,2M,4M,8M)")
    p.add_argument("--plot", default="bench/out/kv_chunk_curve.png",
                   help="where --chunk-sizes writes its PNG (default: %(default)s)")
    p.add_argument("--codec", choices=["raw", "proto"], default="raw",
                   help="how KVChunk messages are written and read (same bytes on the wire): raw = by "
                        "hand, zero-copy on the receiver; proto = the generated stubs (default: "
                        "%(default)s)")
    p.add_argument("--grpc-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra gRPC channel/server option on both ends (int values as ints); repeatable")
    p.add_argument("--floor", action="store_true",
                   help="also time gRPC alone: pre-serialised messages into a receiver that drops them "
                        "(floor_gbps, floor_{sender,receiver}_cpu_s_per_gb)")
    p.add_argument("--stages", action="store_true",
                   help="also time the push's own work without gRPC, stage by stage, in this process "
                        "(stage_encode, stage_encode_serialize, stage_verify, stage_verify_write, in s/GB: "
                        "measure_stages)")
    p.add_argument("--kv-blocks", type=parse_paths, default=["native"], metavar="native,python",
                   help="how each end copies and checksums KV blocks, comma-separated, one case each; the "
                        "headline is the first: native = kv_blocks.cpp, one pass a block (production's on a "
                        "CPU pool where pdserve's CPU kernels build); python = the fallback's gather, "
                        "xxhash and join passes (default: native)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mib", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
