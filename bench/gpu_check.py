"""The one prepared GPU check: pdserve's GPU path on one card, stage by stage, in under 7 minutes.

    python -m bench.gpu_check --out DIR [--stages card,decode,...] [--dry-run] [--device cuda]

No Ray, no Redis, no network and no model files: every model is random weights at a real model's
shapes, written as a Hugging Face folder (bench/gpu_check_model.py) and read by pdserve's loader
and by transformers. Stages, in order (sizes: SIZES below, GPU and dry-run side by side):

  card            device, memory, torch / Triton / CUDA versions; device copy bandwidth (GB/s, bytes
                  read + written, median of reps) and bf16 and fp32 (TF32 off) matmul TFLOP/s
  triton_kernels  pdserve's Triton paged attention (decode and prefill) against the torch reference
                  on a few shapes and every KV row format: max abs error against a stated tolerance
  exactness       SmolLM2-135M's shapes: pdserve's engine against transformers on the device, float32,
                  TF32 off, greedy; identical tokens required (first divergence and its margin given)
  decode          SmolLM2 shapes, decode tokens/s at batch 1 and 64, eager and CUDA graph, as a
                  fraction of the bandwidth bound (weight + KV bytes a step reads / card's bandwidth)
  prefill         SmolLM2 shapes, prefill FLOP/s (2 x params x tokens + attention) / card's matmul peak
  kv_push         a prefill and a decode worker process on one device, production's gRPC KV push
                  between them: the decode side's tokens against one engine's; and the phases timed
                  apart: device-to-host, gRPC wire (host to host), host-to-device, GB/s
  llama_1b        a Llama-3.2-1B-shaped random model: decode and prefill as above

DIR/gpu_check.json is rewritten whole before and after every stage (DIR/gpu_check.log keeps this
process's stderr, DIR/kv_push_*_worker.log the worker processes'), so a stage that kills the process
leaves the ones before it, and itself as "running". A stage still running after --stage-timeout ends
the run, every thread's stack in the log. A stage that raises is recorded (status failed, traceback
tail) and the next one runs; within a stage, a part that raises (one engine, one decode variant)
leaves the other parts their results. Each stage: {name, status ok|failed|skipped, seconds, ...its
results, error}. Progress lines go to stderr.

--dry-run runs every stage's code on tiny shapes on the CPU (TRITON_INTERPRET=1, set before
anything imports Triton), under 2 minutes on 2 cores (tests/test_gpu_check.py): its figures mean
nothing; it proves the script's code paths before a GPU's time is spent on them. docs/gpu.md says
how to run it on a GPU machine and how to read the JSON.
"""

from __future__ import annotations

import os
import sys

# NOTE: before anything imports triton (transformers and pdserve's engine do): the interpreter is
# chosen when triton loads, so --dry-run must be seen here, ahead of argparse.
if "--dry-run" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from bench.common import bench_parser, progress  # noqa: E402
from bench.gpu_check_model import ModelShape, Skip  # noqa: E402

RESULT_FILE = "gpu_check.json"
LOG_FILE = "gpu_check.log"  # this process's stderr (progress, warnings, tracebacks), beside the JSON
ERROR_TAIL_CHARS = 4000


# --- sizes: the GPU run and the dry run, side by side -------------------------------------------
SMOLLM2_135M = ModelShape(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                          vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0)
LLAMA_32_1B = ModelShape(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                         intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, arch="llama3",
                         rope_theta=500000.0)
TINY_SMOL = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                       vocab_size=512, tie_word_embeddings=True, max_position_embeddings=128)
TINY_LLAMA3 = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                         vocab_size=600, tie_word_embeddings=True, arch="llama3", max_position_embeddings=128)


@dataclass(frozen=True)
class AttentionShape:
    """One paged attention case: rows (decode: sequences; prefill: the chunk's new tokens), heads, and
    the tokens before them (decode: each row's context, its own token included; prefill: start)."""

    rows: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context: int
    window: int = 0


@dataclass(frozen=True)
class Sizes:
    copy_mib: int  # card: each of the copy's source and destination
    copy_reps: int
    matmul_n: int  # card: bf16 square matmul
    matmul_fp32_n: int
    matmul_reps: int
    decode_shapes: tuple[AttentionShape, ...]  # triton_kernels
    prefill_shapes: tuple[AttentionShape, ...]
    block_size: int
    smol: ModelShape  # exactness, decode, prefill, kv_push
    exact_prompt_tokens: tuple[int, ...]  # one prompt each
    exact_new_tokens: int
    decode_batches: tuple[int, ...]
    decode_prompt_tokens: int
    decode_new_tokens: int
    prefill_tokens: tuple[int, ...]
    prefill_reps: int
    push_prompt_tokens: int
    push_new_tokens: int
    wire_mib: int
    wire_reps: int
    llama: ModelShape  # llama_1b
    llama_decode_batches: tuple[int, ...]
    llama_new_tokens: int
    llama_prefill_tokens: tuple[int, ...]


GPU = Sizes(
    copy_mib=1024, copy_reps=20, matmul_n=8192, matmul_fp32_n=4096, matmul_reps=10,
    decode_shapes=(AttentionShape(1, 9, 3, 64, 1000), AttentionShape(64, 9, 3, 64, 517),
                   AttentionShape(16, 32, 8, 64, 2048), AttentionShape(8, 9, 3, 64, 300, window=128)),
    prefill_shapes=(AttentionShape(128, 9, 3, 64, 0), AttentionShape(64, 32, 8, 64, 1000),
                    AttentionShape(200, 9, 3, 64, 50, window=96)),
    block_size=16, smol=SMOLLM2_135M,
    exact_prompt_tokens=(7, 64, 300, 1000), exact_new_tokens=32,
    decode_batches=(1, 64), decode_prompt_tokens=512, decode_new_tokens=64,
    prefill_tokens=(512, 2048), prefill_reps=3,
    push_prompt_tokens=1000, push_new_tokens=16, wire_mib=256, wire_reps=3,
    llama=LLAMA_32_1B, llama_decode_batches=(1, 64), llama_new_tokens=32, llama_prefill_tokens=(2048,),
)
DRY_RUN = Sizes(
    copy_mib=8, copy_reps=3, matmul_n=128, matmul_fp32_n=128, matmul_reps=3,
    decode_shapes=(AttentionShape(2, 4, 2, 16, 37), AttentionShape(1, 4, 1, 16, 20, window=8)),
    prefill_shapes=(AttentionShape(5, 4, 2, 16, 11), AttentionShape(6, 4, 2, 16, 0, window=4)),
    block_size=8, smol=TINY_SMOL,
    exact_prompt_tokens=(5, 19), exact_new_tokens=8,
    decode_batches=(1, 4), decode_prompt_tokens=16, decode_new_tokens=6,
    prefill_tokens=(32,), prefill_reps=1,
    push_prompt_tokens=40, push_new_tokens=4, wire_mib=4, wire_reps=1,
    llama=TINY_LLAMA3, llama_decode_batches=(1, 4), llama_new_tokens=4, llama_prefill_tokens=(32,),
)


# --- the run -----------------------------------------------------------------------------------
@dataclass
class Context:
    """What the stages share: sizes, device, a scratch folder for model files (not under --out: a
    Llama-1B folder is GBs), and the card's figures for the stages that divide by them."""

    sizes: Sizes
    device: str
    dry_run: bool
    scratch: Path
    out: Path  # --out: the JSON, and the logs of the processes a stage starts
    card: dict[str, Any] = field(default_factory=dict)
    models: dict[str, Path] = field(default_factory=dict)


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[Context], dict[str, Any]]


def all_stages() -> list[Stage]:
    from bench import gpu_check_push as push
    from bench import gpu_check_stages as s

    return [Stage("card", s.card), Stage("triton_kernels", s.triton_kernels), Stage("exactness", s.exactness),
            Stage("decode", s.decode), Stage("prefill", s.prefill), Stage("kv_push", push.kv_push),
            Stage("llama_1b", s.llama_1b)]


STAGE_NAMES = ("card", "triton_kernels", "exactness", "decode", "prefill", "kv_push", "llama_1b")


def run_stage(stage: Stage, ctx: Context) -> dict[str, Any]:
    progress(f"gpu_check: stage {stage.name} ...")
    started = time.perf_counter()
    record: dict[str, Any] = {"name": stage.name}
    try:
        record.update(stage.run(ctx))
        record["status"] = "ok" if record.get("status") in (None, "ok") else record["status"]
    except Skip as why:
        record.update(status="skipped", reason=str(why))
    except Exception as error:  # noqa: BLE001 -- a failed stage is recorded; the next one still runs
        record.update(status="failed", error=traceback.format_exc()[-ERROR_TAIL_CHARS:],
                      error_type=type(error).__name__)
    record["seconds"] = time.perf_counter() - started
    progress(f"gpu_check: stage {stage.name} {record['status']} in {record['seconds']:.1f} s"
             + (f": {record.get('error_type')}" if record["status"] == "failed" else ""))
    return record


class Tee:
    """stderr written to the terminal and to a file under --out, so the folder that comes back from a
    GPU machine holds the whole story."""

    def __init__(self, stream: Any, path: Path) -> None:
        self.stream, self.file = stream, open(path, "a", buffering=1)  # noqa: SIM115 -- closed in run()

    def write(self, text: str) -> int:
        self.file.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.file.flush()
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def write_result(path: Path, result: dict[str, Any]) -> None:
    """The whole result, written beside and renamed over the last one: a reader never sees half."""
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(result, indent=2, default=str) + "\n")
    partial.replace(path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    device = args.device or ("cpu" if args.dry_run else "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        progress("gpu_check: WARNING: no CUDA device; every stage that needs one will fail (use --dry-run)")
    sizes = DRY_RUN if args.dry_run else GPU
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check-", dir=args.scratch))
    ctx = Context(sizes, device, args.dry_run, scratch, out)
    result: dict[str, Any] = {"check": "gpu_check", "dry_run": args.dry_run, "device": device,
                              "argv": sys.argv[1:], "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "sizes": asdict(sizes), "stages": []}
    started = time.perf_counter()
    sys.stderr = tee = Tee(sys.stderr, out / LOG_FILE)
    try:
        for stage in all_stages():
            if stage.name not in args.stages:
                continue
            # NOTE: written before the stage runs, so a process that dies or hangs in it leaves "running"
            result["stages"].append({"name": stage.name, "status": "running"})
            write_result(out / RESULT_FILE, result)
            faulthandler.dump_traceback_later(args.stage_timeout, exit=True, file=tee.file)
            result["stages"][-1] = run_stage(stage, ctx)
            faulthandler.cancel_dump_traceback_later()
            result["wall_s"] = time.perf_counter() - started
            write_result(out / RESULT_FILE, result)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        sys.stderr = tee.stream
        tee.file.close()
    result["wall_s"] = time.perf_counter() - started
    write_result(out / RESULT_FILE, result)
    return result


def summary(result: dict[str, Any]) -> str:
    lines = [f"gpu_check on {result['device']} ({'dry run' if result['dry_run'] else 'full'}), "
             f"{result['wall_s']:.1f} s"]
    for stage in result["stages"]:
        extra = stage.get("reason") or (stage.get("error", "").strip().splitlines() or [""])[-1]
        line = f"  {stage['name']:<15} {stage['status']:<8} {stage['seconds']:7.1f} s  {extra}"
        lines.append(line.rstrip())
    return "\n".join(lines)


def parse_stages(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in STAGE_NAMES]
    if unknown or not names:
        given = ",".join(unknown) or "nothing"
        raise argparse.ArgumentTypeError(f"{given}: give some of {','.join(STAGE_NAMES)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bench_parser("python -m bench.gpu_check", __doc__)
    p.add_argument("--out", required=True, metavar="DIR",
                   help=f"folder for {RESULT_FILE} (created if needed), rewritten after every stage")
    p.add_argument("--stages", type=parse_stages, default=list(STAGE_NAMES), metavar="A,B",
                   help=f"the stages to run, comma-separated, in the script's order (default: all of "
                        f"{','.join(STAGE_NAMES)})")
    p.add_argument("--dry-run", action="store_true",
                   help="every stage's code on tiny shapes on the CPU, Triton interpreted "
                        "(TRITON_INTERPRET=1): proves the code paths, measures nothing (under 2 minutes on 2 "
                        "cores)")
    p.add_argument("--device", default=None,
                   help="torch device of every stage (default: cuda; cpu with --dry-run)")
    p.add_argument("--stage-timeout", type=float, default=300.0, metavar="S",
                   help="a stage still running after S seconds ends the whole run: every thread's stack goes "
                        f"to {LOG_FILE} and the stage stays 'running' in the JSON (default: %(default)s)")
    p.add_argument("--scratch", default=None, metavar="DIR",
                   help="where the random models are written and removed at the end (default: the system's "
                        "temporary folder; the Llama-1B-shaped one needs about 5 GB)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    print(summary(result), file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
