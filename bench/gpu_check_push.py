"""bench.gpu_check's kv_push stage: a prefill and a decode worker on one device, production's gRPC KV
push between them, and the push's phases timed apart.

    python -m bench.gpu_check_push --serve prefill|decode --model DIR --device DEV ...   (a worker;
                                   bench.gpu_check starts two, you never need to)

Two parts, one stage:

  workers  two processes (subprocess, `--serve`), each a production WorkerServer (gRPC on loopback,
           port 0; no Ray, no Redis) on the same device and the same random SmolLM2-shaped folder.
           Prefill(prompt, decode_target=D) to P: P computes the prompt and pushes its KV to D layer
           by layer (KVTransfer.Push); Decode(first_token) to D continues from that KV. The decode
           side's tokens must equal those of one LLMEngine in this process with the same settings.
           Reported: the Prefill RPC's wall time (compute and push, timed by the client), P's own
           prefill_ms and transfer_ms (the wait for D after the last layer), bytes_sent, and
           push_gbps_with_compute = bytes_sent / the RPC's wall time (a floor on the push's rate).
  phases   production's pieces in this process, on a Llama-3-8B-like pool (sim/measure/wire.py
           make_pool) of wire_mib:
             d2h_encode_gbps   kvwire.encode_layer over a pool on the device, every layer, staged as
                               a GPU prefill worker's sender stages it (pdserve/transfer/staging.py):
                               blocks gathered on the device, copied into a pinned slot on the
                               transfer stream, checksummed on the host; each payload then copied
                               into bytes once, as the channel's serialiser does
             d2h_copy_gbps     the whole pool in one copy to pinned host memory (the copy alone)
             wire_gbps         bench.kv_transfer_wire's gRPC push, host pool to a receiver process's
                               host pool over loopback, checksums and writes included (its Python
                               kv_blocks path: a device pool's path)
             h2d_receive_gbps  kvwire.receive_layer of those frames into a pool on the device, staged
                               as a GPU decode worker's receiver stages it: checksums verified on
                               the host, blocks through pinned slots, copied on the load stream,
                               timed until that stream is done
             h2d_copy_gbps     the whole pool in one copy from pinned host memory (the copy alone)
           GB/s are 1e9 bytes of KV per second; medians of reps after one warm-up.
"""

from __future__ import annotations

import argparse
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench import common
from bench.gpu_check_model import build_engine, device_timed, engine_config, free_device_memory

BLOCK_IDS_SEED = 1
CHUNK_BYTES = 2 << 20
RPC_TIMEOUT_S = 120.0
WORKER_START_S = 180.0  # a worker imports torch, loads the model, builds its engine (CUDA graphs) first


def kv_push(ctx) -> dict[str, Any]:
    from bench.gpu_check_stages import attempt, failed_parts, last_line, model_settings

    s = ctx.sizes
    settings = model_settings(ctx.device)
    failures = []
    result, error = attempt(lambda: through_workers(ctx, settings))
    if error:
        failures.append(f"workers: {last_line(error)}")
        result = {"workers_error": error}
    elif not result["tokens_equal"]:
        failures.append(f"the decode worker's tokens differ from one engine's at index "
                        f"{result['first_divergence']} (used the transferred KV: "
                        f"{result['used_transferred_kv']})")
    free_device_memory(ctx.device)
    result["phases"], error = attempt(lambda: phases(ctx.device, settings["kv_dtype"], s.wire_mib,
                                                     s.wire_reps))
    if error:
        failures.append(f"phases: {last_line(error)}")
        result["phases"] = {"error": error}
    return result | {"kv_dtype": settings["kv_dtype"], "dtype": settings["dtype"]} | failed_parts(failures)


def through_workers(ctx, settings: dict[str, str]) -> dict[str, Any]:
    from bench.gpu_check_stages import load, model_folder, prompts

    s = ctx.sizes
    folder = model_folder(ctx, "smollm2_135m", s.smol)
    blocks = 4 * -(-(s.push_prompt_tokens + s.push_new_tokens) // s.block_size) + 16
    workers = [WorkerProcess.spawn(role, folder, ctx.device, blocks, s.block_size, settings, ctx.out)
               for role in ("prefill", "decode")]
    try:
        loaded = load(ctx, "smollm2_135m", s.smol)
        prompt, warm = prompts((s.push_prompt_tokens, s.push_prompt_tokens), s.smol.vocab_size, seed=21)
        reference = one_engine_tokens(loaded, ctx, prompt, blocks, settings)
        del loaded
        free_device_memory(ctx.device)
        for w in workers:
            w.wait_ready(WORKER_START_S)
        pushed = push_through_workers(workers[0].address, workers[1].address, prompt, warm,
                                      s.push_new_tokens, reference)
        return pushed | {"worker_logs": [w.log.name for w in workers]}
    finally:
        for w in workers:
            w.stop()


def greedy(n: int):
    from pdserve.engine.sequence import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def one_engine_tokens(loaded, ctx, prompt: list[int], blocks: int, settings: dict[str, str]) -> list[int]:
    engine, _ = build_engine(loaded, ctx.device, num_blocks=blocks, block_size=ctx.sizes.block_size,
                             kv_dtype=settings["kv_dtype"], dtype=settings["dtype"], prefix_caching=True)
    tokens = engine.generate([prompt], greedy(ctx.sizes.push_new_tokens), detokenize=False)[0].token_ids
    del engine
    return tokens


def push_through_workers(prefill: str, decode: str, prompt: list[int], warm: list[int], new_tokens: int,
                         reference: list[int]) -> dict[str, Any]:
    import grpc

    from pdserve.grpc_options import message_options
    from pdserve.worker.convert import sampling_to_proto
    from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

    sampling = sampling_to_proto(greedy(new_tokens))
    channels = [grpc.insecure_channel(a, options=message_options()) for a in (prefill, decode)]
    p, d = worker_pb2_grpc.PrefillServiceStub(channels[0]), worker_pb2_grpc.DecodeServiceStub(channels[1])

    def disaggregated(rid: str, ids: list[int]) -> tuple[float, Any, list[int], bool]:
        request = worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling,
                                            decode_target=decode, decode_cached_blocks=0)
        start = time.perf_counter()
        reply = p.Prefill(request, timeout=RPC_TIMEOUT_S)
        wall = time.perf_counter() - start
        resume = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling,
                                          first_token=reply.first_token)
        replies = list(d.Decode(resume, timeout=RPC_TIMEOUT_S))
        used = bool(replies and replies[0].used_transferred_kv)
        return wall, reply, [t for r in replies for t in r.token_ids], used

    try:
        disaggregated("warm", warm)  # CUDA context, kernels and both channels, outside the figures
        wall, reply, tokens, used = disaggregated("measured", prompt)
    finally:
        for channel in channels:
            channel.close()
    first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
    if first is None and len(tokens) != len(reference):
        first = min(len(tokens), len(reference))
    return {"tokens_equal": tokens == reference and used, "used_transferred_kv": used,
            "first_divergence": first, "new_tokens": len(tokens), "prompt_tokens": len(prompt),
            "prefill_rpc_ms": wall * 1e3, "prefill_ms": reply.prefill_ms, "transfer_ms": reply.transfer_ms,
            "bytes_sent": reply.bytes_sent, "layer_blocks_sent": reply.blocks_sent,
            "push_gbps_with_compute": reply.bytes_sent / wall / 1e9}


# --- phases ------------------------------------------------------------------------------------
def phases(device: str, kv_dtype: str, mib: int, reps: int) -> dict[str, Any]:
    from bench.kv_transfer_wire import Case, measure
    from sim.measure.wire import make_pool

    rates = device_phases(make_pool(mib, kv_dtype).to(device), reps)
    free_device_memory(device)
    common.progress(f"gpu_check: kv_push wire, {mib} MiB through gRPC to a receiver process")
    wire = measure(Case(mib, kv_dtype, reps, CHUNK_BYTES, "raw", native=False))
    return {**rates, "wire_gbps": wire["grpc_gbps"], "wire_tcp_gbps": wire["tcp_gbps"], "mib": mib,
            "reps": reps, "pool": "sim/measure/wire.py make_pool: 32 layers, 8 KV heads, head_dim 128",
            "chunk_bytes": CHUNK_BYTES}


def device_phases(pool: torch.Tensor, reps: int) -> dict[str, float]:
    """The four phases on a pool on the device (held only while this runs)."""
    from pdserve.kvwire import KVLayout, decode_header, encode_layer, receive_layer
    from sim.measure.wire import FINGERPRINT

    device, nbytes = pool.device, pool.numel() * pool.element_size()
    send, receive = staged_copies(device), staged_copies(device)
    layout = KVLayout.of_cache(pool, FINGERPRINT)
    num_blocks = pool.shape[2]
    block_ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(BLOCK_IDS_SEED)).tolist()
    positions = list(range(num_blocks))

    def encode_all() -> list[tuple[bytes, bytes]]:
        return [(bytes(h), bytes(p)) for layer in range(layout.num_layers)
                for h, p in encode_layer(pool, layer, block_ids, positions, "gpu-check", CHUNK_BYTES,
                                         **send)]

    frames = encode_all()
    into = torch.zeros_like(pool)

    def receive_all() -> None:
        for header, payload in frames:
            chunk = decode_header(header)
            ids = [block_ids[q] for q in chunk.positions]
            receive_layer(into, chunk, payload, layout, ids, **receive)
        if receive:  # the staged loads run on their own stream: the blocks are usable once it is done
            receive["staged"].record().synchronize()

    pinned = torch.empty(pool.shape, dtype=pool.dtype, pin_memory=device.type == "cuda")
    rates = {
        "d2h_encode_gbps": _gbps(nbytes, encode_all, device, reps),
        "d2h_copy_gbps": _gbps(nbytes, lambda: pinned.copy_(pool), device, reps),
        "h2d_receive_gbps": _gbps(nbytes, receive_all, device, reps),
        "h2d_copy_gbps": _gbps(nbytes, lambda: into.copy_(pinned, non_blocking=True), device, reps),
    }
    into.zero_()
    receive_all()
    if not torch.equal(into.view(torch.uint8), pool.view(torch.uint8)):
        raise RuntimeError("the pool received on the device differs from the pool sent")
    return rates | {"path": "staged" if send else "unstaged (no pdserve/transfer/staging.py)"}


def staged_copies(device: torch.device) -> dict[str, Any]:
    """encode_layer's and receive_layer's `staged` argument as a worker on this device passes it: a
    ring of pinned slots and a stream of its own (pdserve/transfer/staging.py). On the CPU the same
    code runs on CpuStreams' threads (a CPU worker takes no staging: its pool path is kv_blocks')."""
    try:
        from pdserve.engine.device_streams import streams_for
        from pdserve.transfer.staging import StagedCopies
    except ImportError:
        return {}
    return {"staged": StagedCopies.create(streams_for(device), CHUNK_BYTES)}


def _gbps(nbytes: int, fn, device: torch.device, reps: int) -> float:
    fn()  # warm-up: allocations, pinned pages, kernels
    return nbytes / common.median([device_timed(fn, device)[0] for _ in range(reps)]) / 1e9


# --- the worker processes ----------------------------------------------------------------------
@dataclass
class WorkerProcess:
    """A worker child: its first stdout line says where it serves; its stderr goes to a log under
    --out, which comes back with the JSON (a worker that dies says why there)."""

    proc: Any
    role: str
    log: Path
    address: str = ""

    @classmethod
    def spawn(cls, role: str, folder, device: str, num_blocks: int, block_size: int,
              settings: dict[str, str], out: Path) -> WorkerProcess:
        argv = ["-m", "bench.gpu_check_push", "--serve", role, "--model", str(folder), "--device", device,
                "--num-blocks", str(num_blocks), "--block-size", str(block_size),
                "--kv-dtype", settings["kv_dtype"], "--dtype", settings["dtype"]]
        log = out / f"kv_push_{role}_worker.log"
        with open(log, "w") as stderr:
            proc = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=stderr, text=True)
        return cls(proc, role, log)

    def wait_ready(self, timeout_s: float) -> None:
        """The worker's address; RuntimeError with its log's tail if it exits or is silent for timeout_s."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline().split() if ready else []
        if len(line) != 3 or line[0] != "address":
            self.proc.kill()
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"the {self.role} worker did not report its address within {timeout_s:.0f} s "
                               f"(exit {self.proc.wait()}); its log ends:\n{tail}")
        self.address = line[1]

    def stop(self) -> None:
        common.stop_child(self.proc, timeout_s=20)


def serve(args: argparse.Namespace) -> None:
    """One production WorkerServer on a free loopback port until stdin closes."""
    from decode_worker.role import DecodeRole
    from pdserve.engine.weights import load_model
    from pdserve.worker.server import WorkerConfig, WorkerServer
    from prefill_worker.role import PrefillRole

    config, _ = engine_config(args.device, num_blocks=args.num_blocks, block_size=args.block_size,
                              kv_dtype=args.kv_dtype, dtype=args.dtype, prefix_caching=True)
    role = PrefillRole() if args.serve == "prefill" else DecodeRole()
    server = WorkerServer(WorkerConfig(args.serve, config, metrics_port=None), role,
                          load_model(args.model, progress=False))
    address = server.start()
    print(f"address {address} {server.engine.device}", flush=True)
    sys.stdin.read()  # the parent closes stdin when it is done
    server.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.bench_parser("python -m bench.gpu_check_push", __doc__)
    p.add_argument("--serve", choices=["prefill", "decode"], required=True,
                   help="serve one worker of this role until stdin closes")
    p.add_argument("--model", required=True, metavar="DIR", help="the Hugging Face folder the worker loads")
    p.add_argument("--device", default="cuda", help="torch device of the worker's engine (default: cuda)")
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks of the worker's pool (default 256)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--kv-dtype", default="float32", help="KV cache dtype (default float32)")
    p.add_argument("--dtype", default="float32",
                   help="the engine's weight dtype, where EngineConfig has the setting (default float32)")
    return p.parse_args(argv)


if __name__ == "__main__":
    serve(parse_args())
