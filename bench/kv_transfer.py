"""Time to first token of a disaggregated prefill against the same prefill on the decode worker.

    python -m bench.kv_transfer [--json] [--quick] [--reps N] [--prompt-tokens 2048] [--threads N]
                                [--kv-dtype D] [--bytes-dtypes float32,float16,bfloat16,int8,fp8]

Three parts, one run:

  wire   bench.kv_transfer_wire's comparison, called as is: KV blocks through gRPC
         KVTransfer.Push against the same bytes through a raw TCP socket, 64 and 512 MiB,
         two processes over loopback. Its keys are carried unchanged (grpc_gbps, tcp_gbps,
         ratio = grpc / tcp, checksum_overhead), from its largest size.
  ttft   two real WorkerServers on SmolLM2 (load_model(None)), each in its own process:

           disaggregated  Prefill(prompt, decode_target=D) to the prefill worker P, timed from
                          the call to its reply. P streams each layer's blocks to D while it
                          computes the next; the reply (with the first token) comes only after
                          D has verified and written every block and answered Push (see
                          WorkerServicer._finish_prefill: transfer.close(), then transfer.wait()).
           local          Decode(prompt, prefill_here=True, max_tokens=1) to D itself, timed
                          from the call to its first reply (the first token).

         ttft_ratio = disaggregated / local, medians over reps, the two alternating rep by
         rep (which goes first swaps every rep). Each rep's disaggregated request is then
         finished on D (Decode with the first token, untimed), so nothing stays parked.
  bytes  for each of --bytes-dtypes, a P and D pair of that KV dtype (processes as above) and one
         disaggregated prefill of --bytes-tokens tokens (whole blocks): PrefillReply.bytes_sent per
         prompt token, the scales of int8/fp8 included, checked against the KV formula; and its
         ratio to float32's and float16's (kv_bytes_per_token, kv_bytes_per_token_vs_float32, ...).

Every request gets a prompt no worker has seen: the same random body behind a first token
of its own. There is no RPC to clear a worker's prefix cache, and none is needed: block
hashes chain from the first block, so a new first token changes every block's hash and
nothing can match. Each reply's usage.cached_tokens is checked to be 0.

NOTE: the two worker processes share this machine's cores (2 on the development VM) with
each other, with the client and with anything else running: while P computes, D receives,
verifies and writes, so on 2 cores the overlap is real but tight. Each worker gets --threads
torch threads (default 1) so that neither takes the other's core.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from bench import common
from bench.kv_transfer_wire import MIB, Case, keep_freed_memory, measure
from pdserve.engine.config import KV_DTYPES, CacheConfig, EngineConfig, kv_bytes_per_token
from pdserve.engine.sequence import SamplingParams
from pdserve.grpc_options import message_options
from pdserve.transfer.frames import DEFAULT_MAX_CHUNK_BYTES
from pdserve.units import ceil_div
from pdserve.worker.convert import sampling_to_proto
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

BLOCK_SIZE = 16
FIRST_TOKEN_BASE = 1000  # request k's prompt starts with token FIRST_TOKEN_BASE + k
GREEDY_ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
RPC_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Sizes:
    """FULL gives the documented keys; QUICK is a smoke run."""

    wire_mib: tuple[int, ...] = (64, 512)
    wire_reps: int = 3
    prompt_tokens: int = 2048
    reps: int = 3
    bytes_tokens: int = 512  # the bytes part's prompt: whole blocks, so bytes per token is exact


FULL = Sizes()
QUICK = Sizes(wire_mib=(16, 64), wire_reps=1, prompt_tokens=512, reps=1, bytes_tokens=64)


# --- the workers ------------------------------------------------------------------------------


def serve_worker(role: str, threads: int, kv_dtype: str, num_blocks: int) -> None:
    """A worker process: one WorkerServer on a free loopback port until stdin closes."""
    from decode_worker.role import DecodeRole
    from pdserve.engine.weights import load_model
    from pdserve.worker.server import WorkerConfig, WorkerServer
    from prefill_worker.role import PrefillRole

    common.set_threads(threads)
    engine = EngineConfig(cache=CacheConfig(block_size=BLOCK_SIZE, kv_dtype=kv_dtype, num_blocks=num_blocks),
                          num_threads=threads)
    server = WorkerServer(WorkerConfig(role, engine), PrefillRole() if role == "prefill" else DecodeRole(),
                          load_model(None, progress=False))
    address = server.start()
    print(f"address {address} {server.engine.device}", flush=True)
    sys.stdin.read()  # the parent closes stdin when it is done
    server.stop()


@dataclass
class WorkerProcess:
    proc: subprocess.Popen
    role: str
    address: str = ""
    device: str = ""

    @classmethod
    def spawn(cls, role: str, threads: int, kv_dtype: str, num_blocks: int) -> WorkerProcess:
        argv = ["bench.kv_transfer", "--serve-worker", role, "--threads", str(threads),
                "--kv-dtype", kv_dtype, "--num-blocks", str(num_blocks)]
        return cls(common.serving_child(argv), role)

    def wait_ready(self) -> None:
        self.address, self.device = common.child_report(self.proc, "address", f"{self.role} worker process")

    def stop(self) -> None:
        common.stop_child(self.proc, timeout_s=20)


# --- the two sides ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Disaggregated:
    ttft_s: float
    prefill_ms: float  # PrefillReply.prefill_ms: submit -> first token sampled, on P
    transfer_ms: float  # PrefillReply.transfer_ms: the wait for D's answer after the last layer
    bytes_sent: int
    blocks_sent: int  # (layer, block) pairs


@dataclass(frozen=True)
class Local:
    ttft_s: float
    prefill_ms: float  # DecodeReply.prefill_ms on the first reply, as D measured it


class Pair:
    """Client ends of one prefill worker P and one decode worker D."""

    def __init__(self, prefill_address: str, decode_address: str) -> None:
        self.decode_address = decode_address
        self._channels = [grpc.insecure_channel(a, options=message_options()) for a in (prefill_address,
                                                                                        decode_address)]
        self.p = worker_pb2_grpc.PrefillServiceStub(self._channels[0])
        self.d = worker_pb2_grpc.DecodeServiceStub(self._channels[1])
        self.sampling = sampling_to_proto(GREEDY_ONE)

    def disaggregated(self, rid: str, prompt: list[int]) -> Disaggregated:
        request = worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=self.sampling,
                                            decode_target=self.decode_address, decode_cached_blocks=0)
        start = time.perf_counter()
        reply = self.p.Prefill(request, timeout=RPC_TIMEOUT_S)
        ttft = time.perf_counter() - start
        _expect_cold(rid, reply.usage)
        self._finish_on_decode(rid, prompt, reply)
        return Disaggregated(ttft, reply.prefill_ms, reply.transfer_ms, reply.bytes_sent, reply.blocks_sent)

    def _finish_on_decode(self, rid: str, prompt: list[int], prefill: worker_pb2.PrefillReply) -> None:
        """Resume the parked KV with P's first token (max_tokens=1 ends it at once): frees D's blocks."""
        request = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=self.sampling,
                                           first_token=prefill.first_token)
        replies = list(self.d.Decode(request, timeout=RPC_TIMEOUT_S))
        if not replies or not replies[0].used_transferred_kv:
            raise RuntimeError(f"request {rid}: D did not resume from the transferred KV; the "
                               "disaggregated timing would not be what it claims")

    def local(self, rid: str, prompt: list[int]) -> Local:
        request = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=self.sampling,
                                           prefill_here=True)
        start = time.perf_counter()
        call = self.d.Decode(request, timeout=RPC_TIMEOUT_S)
        first = next(call)
        ttft = time.perf_counter() - start
        replies = [first, *call]
        if first.used_transferred_kv or not first.token_ids:
            raise RuntimeError(f"request {rid}: the first Decode reply carries no locally prefilled token")
        _expect_cold(rid, replies[-1].usage)
        return Local(ttft, first.prefill_ms)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


def _expect_cold(rid: str, usage: Any) -> None:
    if usage.cached_tokens:
        raise RuntimeError(f"request {rid}: {usage.cached_tokens} prompt tokens came from the prefix cache; "
                           "every timed prompt must be computed in full")


def prompt_for(body: list[int], k: int) -> list[int]:
    """Request k's prompt: a first token of its own, then the body every request shares.

    NOTE: this is what clears the prefix caches between reps. Block hashes chain from the first
    block, so a new first token gives every block of the prompt a hash no worker holds, on P and
    on D alike (the Worker service has no cache-reset RPC). _expect_cold checks each reply.
    """
    return [FIRST_TOKEN_BASE + k, *body[1:]]


# --- the measurements ---------------------------------------------------------------------------


def bench_wire(sizes: Sizes) -> dict[str, Any]:
    keep_freed_memory()  # as bench.kv_transfer_wire's own main does, so its figures reproduce here
    rows = []
    for mib in sizes.wire_mib:
        common.progress(f"wire: {mib} MiB float16, gRPC vs raw TCP, {sizes.wire_reps} reps")
        rows.append(measure(Case(mib, "float16", sizes.wire_reps, 2 * MIB, "raw")))
    headline = rows[-1]
    return {**{k: headline[k] for k in ("grpc_gbps", "tcp_gbps", "ratio", "checksum_overhead")},
            "wire_mib": headline["mib"], "wire_cases": rows}


def bench_bytes_per_token(sizes: Sizes, threads: int, kv_dtypes: list[str]) -> dict[str, Any]:
    """KV bytes one disaggregated prefill sends per prompt token, for each KV dtype."""
    n = sizes.bytes_tokens
    body = [FIRST_TOKEN_BASE * 2 + j for j in range(n)]
    per_token: dict[str, float] = {}
    for kv_dtype in kv_dtypes:
        common.progress(f"bytes: one {n}-token prefill through a {kv_dtype} prefill and decode worker")
        workers = [WorkerProcess.spawn(role, threads, kv_dtype, 2 * ceil_div(n, BLOCK_SIZE) + 16)
                   for role in ("prefill", "decode")]
        try:
            for w in workers:
                w.wait_ready()
            pair = Pair(workers[0].address, workers[1].address)
            try:
                sent = pair.disaggregated(f"bytes-{kv_dtype}", prompt_for(body, 0)).bytes_sent
            finally:
                pair.close()
        finally:
            for w in workers:
                w.stop()
        per_token[kv_dtype] = sent / n
    return {"kv_bytes_per_token": per_token, "bytes_tokens": n,
            **{f"kv_bytes_per_token_vs_{base}": {d: b / per_token[base] for d, b in per_token.items()}
               for base in ("float32", "float16") if base in per_token}}


def check_bytes_against_the_formula(result: dict[str, Any]) -> None:
    """Each dtype's bytes on the wire per token must be what the KV formula says SmolLM2's cost."""
    from pdserve.engine.weights import default_model_path
    from pdserve.plan import read_kv_shape

    shape = read_kv_shape(default_model_path())
    for kv_dtype, sent in result["kv_bytes_per_token"].items():
        expected = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, kv_dtype)
        if sent != expected:
            raise RuntimeError(f"{kv_dtype}: {sent} bytes a token went over the wire; the KV formula "
                               f"says {expected}")


def bench_ttft(sizes: Sizes, threads: int, kv_dtype: str) -> dict[str, Any]:
    blocks_per_prompt = ceil_div(sizes.prompt_tokens, BLOCK_SIZE)
    num_blocks = 4 * blocks_per_prompt + 16  # room for a reservation, a local prefill and spare
    common.progress(f"ttft: starting a prefill and a decode worker ({threads} torch thread(s) each, "
             f"{num_blocks} KV blocks of {kv_dtype})")
    workers = [WorkerProcess.spawn(role, threads, kv_dtype, num_blocks) for role in ("prefill", "decode")]
    try:
        for w in workers:
            w.wait_ready()
        prefill, decode = workers
        pair = Pair(prefill.address, decode.address)
        try:
            return {**_run_reps(pair, sizes), "device": decode.device, "num_blocks": num_blocks}
        finally:
            pair.close()
    finally:
        for w in workers:
            w.stop()


def _run_reps(pair: Pair, sizes: Sizes) -> dict[str, Any]:
    rng = random.Random(0)
    body = [rng.randrange(FIRST_TOKEN_BASE * 2, 49152) for _ in range(sizes.prompt_tokens)]
    requests = iter(range(1_000_000))
    common.progress(f"ttft: warm-up, one request each way ({sizes.prompt_tokens:,} tokens)")
    k = next(requests)
    pair.disaggregated(f"warm-{k}", prompt_for(body, k))
    k = next(requests)
    pair.local(f"warm-{k}", prompt_for(body, k))
    disagg: list[Disaggregated] = []
    local: list[Local] = []
    for rep in range(sizes.reps):
        first = "disaggregated" if rep % 2 == 0 else "local"
        common.progress(f"ttft: rep {rep + 1}/{sizes.reps} ({first} first)")
        sides = [("d", pair.disaggregated), ("l", pair.local)]
        for kind, call in sides if rep % 2 == 0 else sides[::-1]:
            k = next(requests)
            result = call(f"{kind}-{k}", prompt_for(body, k))
            (disagg if kind == "d" else local).append(result)
    disagg_s, local_s = common.median([r.ttft_s for r in disagg]), common.median([r.ttft_s for r in local])
    bytes_sent = {r.bytes_sent for r in disagg}
    if len(bytes_sent) != 1:
        raise RuntimeError(f"requests of the same length sent different byte counts: {sorted(bytes_sent)}")
    return {
        "ttft_ratio": common.ratio(disagg_s, local_s),
        "disagg_ttft_ms": disagg_s * 1e3,
        "local_ttft_ms": local_s * 1e3,
        "disagg_prefill_ms": common.median([r.prefill_ms for r in disagg]),
        "transfer_ms": common.median([r.transfer_ms for r in disagg]),
        "local_prefill_ms": common.median([r.prefill_ms for r in local]),
        "bytes_per_request": bytes_sent.pop(),
        "layer_blocks_per_request": disagg[0].blocks_sent,
        "disagg_ttft_ms_all": [r.ttft_s * 1e3 for r in disagg],
        "local_ttft_ms_all": [r.ttft_s * 1e3 for r in local],
        "transfer_ms_all": [r.transfer_ms for r in disagg],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = QUICK if args.quick else FULL
    given = {"reps": args.reps, "wire_reps": args.reps, "prompt_tokens": args.prompt_tokens,
             "bytes_tokens": args.bytes_tokens}
    overrides = {k: v for k, v in given.items() if v is not None}
    sizes = Sizes(**{**asdict(sizes), **overrides})
    threads = common.set_threads(args.threads)
    cores = len(os.sched_getaffinity(0))
    load_at_start = common.warn_if_busy(threads)
    result = bench_wire(sizes)
    result.update(bench_ttft(sizes, args.threads, args.kv_dtype))
    result.update(bench_bytes_per_token(sizes, args.threads, args.bytes_dtypes))
    check_bytes_against_the_formula(result)
    notes = [f"the prefill and decode workers are two processes sharing {cores} cores "
             f"({args.threads} torch thread(s) each), with the client and anything else running",
             "wire: bench.kv_transfer_wire, float16 pools of Llama-3-8B-like blocks, codec raw, "
             f"{DEFAULT_MAX_CHUNK_BYTES >> 20} MiB chunks; ttft: SmolLM2-135M, KV in {args.kv_dtype}"]
    env = {**common.environment(threads), "loadavg_at_start": load_at_start}
    return {**result, "prompt_tokens": sizes.prompt_tokens, "kv_dtype": args.kv_dtype,
            "threads_per_process": args.threads, "reps": sizes.reps, "quick": args.quick,
            "sizes": asdict(sizes), "notes": notes, "environment": env}


def report(r: dict[str, Any]) -> str:
    wire = common.format_table(["MiB", "grpc GB/s", "tcp GB/s", "ratio", "checksum_overhead"],
                        [[c["mib"], c["grpc_gbps"], c["tcp_gbps"], c["ratio"], c["checksum_overhead"]]
                         for c in r["wire_cases"]])
    n = r["prompt_tokens"]
    ttft = common.format_table(["TTFT", "median ms", "detail"], [
        [f"disaggregated, {n:,} tokens", r["disagg_ttft_ms"],
         f"prefill {r['disagg_prefill_ms']:.1f} ms + wait after last layer {r['transfer_ms']:.1f} ms"],
        [f"local on D, {n:,} tokens", r["local_ttft_ms"], f"prefill {r['local_prefill_ms']:.1f} ms"],
    ])
    return "\n".join([
        f"wire (bench.kv_transfer_wire): ratio = grpc / tcp; headline = {r['wire_mib']} MiB", wire, "",
        f"ttft_ratio = disaggregated / local = {r['ttft_ratio']:.3f} "
        f"(median of {r['reps']} reps, device {r['device']})",
        ttft,
        f"KV per request: {r['bytes_per_request'] / 1e6:.1f} MB "
        f"({r['layer_blocks_per_request']:,} layer-blocks, {r['kv_dtype']})", "",
        f"KV bytes sent per prompt token ({r['bytes_tokens']}-token prefills, scales included)",
        common.format_table(["dtype", "bytes/token", "x float32's", "x float16's"],
                     [[d, b, r.get("kv_bytes_per_token_vs_float32", {}).get(d, "-"),
                       r.get("kv_bytes_per_token_vs_float16", {}).get(d, "-")]
                      for d, b in r["kv_bytes_per_token"].items()]), "",
        *(f"note: {note}" for note in r["notes"]),
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.bench_parser("python -m bench.kv_transfer", __doc__)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: wire at 16 and 64 MiB, a 512-token prompt, 1 rep of each")
    p.add_argument("--reps", type=int, default=None,
                   help="timed reps of each side, for the wire and the TTFT parts alike "
                        "(default 3; 1 with --quick), after one warm-up each")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="prompt length of the TTFT comparison (default 2048; 512 with --quick)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads in each worker process and in this one (default 1: the two workers "
                        "share the machine's cores)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="float32",
                   help="KV cache dtype of the TTFT part's two workers (default float32, as `pdserve up`)")
    p.add_argument("--bytes-dtypes", type=lambda t: [d for d in t.split(",") if d], default=list(KV_DTYPES),
                   help="KV dtypes of the bytes part, comma-separated; each gets its own pair of workers "
                        f"(default: {','.join(KV_DTYPES)})")
    p.add_argument("--bytes-tokens", type=int, default=None,
                   help="prompt length of the bytes part, a multiple of the block size 16 "
                        "(default 512; 64 with --quick)")
    p.add_argument("--serve-worker", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    p.add_argument("--num-blocks", type=int, default=0, help=argparse.SUPPRESS)
    least = {"reps": 1, "prompt_tokens": 1, "bytes_tokens": 1, "threads": 1}
    args = common.check_least(p, p.parse_args(argv), least)
    if args.bytes_tokens is not None and args.bytes_tokens % BLOCK_SIZE:
        p.error(f"--bytes-tokens must be a multiple of the block size {BLOCK_SIZE}, got {args.bytes_tokens}")
    unknown = [d for d in args.bytes_dtypes if d not in KV_DTYPES]
    if unknown or not args.bytes_dtypes:
        p.error(f"--bytes-dtypes: {','.join(unknown) or 'nothing'}; give some of {','.join(KV_DTYPES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.serve_worker:
        return serve_worker(args.serve_worker, args.threads, args.kv_dtype, args.num_blocks)
    result = run(args)
    common.publish(report(result), result, args.json)


if __name__ == "__main__":
    main()
