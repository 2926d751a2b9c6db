"""Helpers shared by the benchmarks: threads, timing, medians, peak FLOP/s, tables, JSON, and the
virtualenvs of the peers that must not touch the project's own dependencies.

Every benchmark measures pdserve and its peer side by side in one process and
reports medians and ratios from that same run: the machines these run on are
small and noisy, so absolute figures from different runs do not compare.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch


def set_threads(num_threads: int | None) -> int:
    """Give torch num_threads intra-op threads (None: one per usable core) and one inter-op thread.

    Both sides of a comparison run in this process, so they share the setting.
    """
    n = num_threads or len(os.sched_getaffinity(0))
    if n < 1:
        raise ValueError(f"--threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already fixed: inter-op threads can only be set before the first parallel op
    return torch.get_num_threads()


def progress(message: str) -> None:
    """One line on stderr, so that --json's stdout stays machine-readable."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values: run at least one rep")
    return float(statistics.median(values))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call, on the monotonic high-resolution clock."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def ratio(ours: float, theirs: float) -> float:
    return ours / theirs if theirs else float("nan")


def peak_matmul_flops(sizes: Sequence[int] = (1024, 1536, 2048), reps: int = 5) -> dict[str, Any]:
    """fp32 matmul FLOP/s (2·n³ per product) per square size and kernel, median of reps; peak = the
    best of all: torch.mm (MKL on x86) and, where the build has it, oneDNN, which reaches about twice
    MKL's figure on AMD CPUs (python -m bench.matmul_kernels), so a fraction of peak is not flattered."""
    from pdserve.engine.linear import OneDNNLinear, onednn_available

    kernels = {"mm": torch.mm}
    if onednn_available(torch.device("cpu")):
        kernels["onednn"] = lambda a, b: OneDNNLinear()(a, b)
    per_size: dict[str, float] = {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        for name, product in kernels.items():
            product(a, b)  # warm-up: first call pays for allocation and kernel selection
            seconds = [timed(lambda a=a, b=b, f=product: f(a, b))[0] for _ in range(reps)]
            per_size[f"{name}_{n}"] = 2 * n**3 / median(seconds)
    return {"peak_flops": max(per_size.values()), "flops_by_size": per_size, "reps": reps}


def copy_bandwidth(mib: int = 512, reps: int = 5) -> dict[str, Any]:
    """Memory bandwidth of a large fp32 tensor copy, STREAM's convention (bytes read + bytes
    written per second), median of reps: the ceiling for a step that streams its weights."""
    src = torch.ones(mib * 1024 * 1024 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first touch of dst's pages
    seconds = [timed(lambda: dst.copy_(src))[0] for _ in range(reps)]
    return {"copy_bytes_per_s": 2 * src.numel() * 4 / median(seconds), "copy_mib": mib, "reps": reps}


def environment(num_threads: int) -> dict[str, Any]:
    return {
        "threads": num_threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_cores": len(os.sched_getaffinity(0)),
        "cuda": torch.cuda.is_available(),
        "loadavg_1min": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def warn_if_busy(num_threads: int) -> float:
    """Warn when other processes already keep the cores busy; returns the 1-minute load average.

    NOTE: on a 2-core machine a second busy process makes every op that enters an OpenMP
    parallel region wait for a descheduled worker (~10 ms each), whatever its size, so
    figures measured under load say more about the scheduler than about the code. (Workers
    sleep at barriers instead, OMP_WAIT_POLICY=PASSIVE, which halves that: bench.omp_wait_policy.)
    """
    load = os.getloadavg()[0]
    if load > 0.5:
        progress(f"WARNING: load average is {load:.2f} before the benchmark starts; with "
                 f"{num_threads} threads on {len(os.sched_getaffinity(0))} cores the figures will be noisy")
    return load


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain left-aligned text table; floats get 3 significant decimals."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda values: "  ".join(str(v).ljust(w) for v, w in zip(values, widths)).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.1f}"
    return str(value)


def bench_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A benchmark's command line: its module docstring as --help (the summary, then the details
    as written) and --json, which every benchmark takes."""
    summary, _, details = doc.partition("\n\n")
    p = argparse.ArgumentParser(prog=prog, description=summary, epilog=details,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true",
                   help="print the results as one JSON object on the last line of stdout "
                        "(the tables then go to stderr)")
    return p


def add_threads_flag(p: argparse.ArgumentParser, what: str = "torch intra-op threads") -> None:
    """--threads N, None when not given: set_threads then takes one per usable CPU core."""
    p.add_argument("--threads", type=int, default=None, help=f"{what} (default: one per usable CPU core)")


def check_least(p: argparse.ArgumentParser, args: argparse.Namespace,
                least: dict[str, int]) -> argparse.Namespace:
    """`args`, after a usage error naming the flag when a given value is below its least (None: not
    given)."""
    for name, bound in least.items():
        value = getattr(args, name)
        if value is not None and value < bound:
            p.error(f"--{name.replace('_', '-')} must be >= {bound}, got {value}")
    return args


def emit_json(result: dict[str, Any]) -> None:
    """The result as one JSON object on the last line of stdout."""
    print(json.dumps(result, sort_keys=False), flush=True)


def publish(table: str, result: dict[str, Any], as_json: bool) -> None:
    """The table for people, and with --json the result for machines: the table then goes to stderr
    and the JSON object is stdout's last line."""
    print(table, file=sys.stderr if as_json else sys.stdout, flush=True)
    if as_json:
        emit_json(result)


def run_timed(run: Callable[[Any], dict[str, Any]], report: Callable[[dict[str, Any]], str],
              args: Any) -> None:
    """Run a benchmark, add its wall time (wall_s) to the result and publish it (table, and JSON
    with --json)."""
    started = time.perf_counter()
    result = run(args)
    result["wall_s"] = time.perf_counter() - started
    publish(report(result), result, args.json)


KERNEL_AUTO_HELP = ("auto picks native where the CPU and pdserve's built extension run it, else torch's "
                    "(pdserve/engine/kernel_choice.py); avx2 is native's old name")
LINEAR_KERNEL_HELP = ("pdserve's matmul kernel (EngineConfig.linear_kernel, pdserve/engine/linear.py): "
                      "matmul is torch's own, as transformers runs it; onednn is oneDNN, as vLLM's CPU build "
                      "calls it; native is pdserve's panel matmul at every row count, 16 lanes where the CPU "
                      f"has AVX-512 (pdserve/engine/panel_matmul.cpp); {KERNEL_AUTO_HELP} "
                      "(default: %(default)s)")
ATTENTION_KERNEL_HELP = ("pdserve's attention (EngineConfig.attention_kernel, "
                         "pdserve/engine/model.py): sdpa is torch's, over each sequence's blocks gathered "
                         "into a dense copy; native is pdserve's own paged kernels for decode rows and "
                         "prefill chunks, reading the rows where they lie in the pool "
                         "(pdserve/engine/decode_attention.cpp, prefill_attention.cpp); "
                         f"{KERNEL_AUTO_HELP} (default: %(default)s)")
POINTWISE_KERNEL_HELP = ("RMSNorm, the residual add, RoPE and SiLU·up (EngineConfig.pointwise_kernel, "
                         "pdserve/engine/pointwise.py): torch is torch's ops, as transformers runs them; "
                         "native is pdserve's fused kernels, one pass over the rows each "
                         f"(pdserve/engine/pointwise.cpp); {KERNEL_AUTO_HELP} (default: %(default)s)")
KERNEL_FLAGS = ("linear_kernel", "attention_kernel", "pointwise_kernel")


def add_kernel_flags(p: argparse.ArgumentParser) -> None:
    """--linear-kernel, --attention-kernel and --pointwise-kernel, as EngineConfig names them, with its
    defaults (auto): no flag runs what a user gets."""
    from pdserve.engine.config import (
        ATTENTION_KERNELS,
        KERNEL_ALIASES,
        LINEAR_KERNELS,
        POINTWISE_KERNELS,
        EngineConfig,
    )

    default = EngineConfig()
    for name, known, text in (("linear_kernel", LINEAR_KERNELS, LINEAR_KERNEL_HELP),
                              ("attention_kernel", ATTENTION_KERNELS, ATTENTION_KERNEL_HELP),
                              ("pointwise_kernel", POINTWISE_KERNELS, POINTWISE_KERNEL_HELP)):
        p.add_argument("--" + name.replace("_", "-"), choices=(*known, *KERNEL_ALIASES),
                       default=getattr(default, name), help=text)


def kernel_settings(args: Any) -> dict[str, str]:
    """The kernel flags' values, by EngineConfig's field names (for Ours(...) and a result's JSON)."""
    return {name: getattr(args, name) for name in KERNEL_FLAGS}


def kernel_argv(args: Any) -> list[str]:
    """The kernel flags again, for a child process's command line."""
    return [arg for name in KERNEL_FLAGS for arg in ("--" + name.replace("_", "-"), getattr(args, name))]


# --- a peer's own virtualenv -------------------------------------------------------------------
VENV_STAMP = "pdserve-peer-stamp.json"


def serving_child(argv: Sequence[str]) -> subprocess.Popen:
    """A `python -m ...` child that serves until its stdin closes (stop_child), saying where on its
    first line of stdout (child_report)."""
    return subprocess.Popen([sys.executable, "-m", *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def child_report(proc: subprocess.Popen, word: str, what: str) -> tuple[str, str]:
    """The two values of the child's first line, `WORD A B`; the child is killed if it says otherwise."""
    line = proc.stdout.readline().split()
    if len(line) != 3 or line[0] != word:
        proc.kill()
        raise RuntimeError(f"{what} did not report its {word} (exit {proc.wait()})")
    return line[1], line[2]


def stop_child(proc: subprocess.Popen, timeout_s: float) -> None:
    """Close the child's stdin, its signal to stop; kill it if it has not exited after timeout_s."""
    if proc.stdin:
        proc.stdin.close()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path, steps: Mapping[str, list[str]], pins: Mapping[str, str], what: str,
                hints: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Make venv by running steps (named commands, in order) unless its stamp records these pins;
    returns the stamp (pins, install_s, steps_s, installed_now). A failed step raises RuntimeError
    naming its command, with hints[step] when given."""
    stamp = venv / VENV_STAMP
    if stamp.is_file():
        recorded = json.loads(stamp.read_text())
        if all(recorded.get(name) == version for name, version in pins.items()):
            return {**recorded, "installed_now": False}
    wanted = ", ".join(f"{name} {version}" for name, version in pins.items())
    progress(f"creating {what}'s virtualenv at {venv} ({wanted}; minutes)")
    began = time.perf_counter()
    times: dict[str, float] = {}
    for step, command in steps.items():
        step_start = time.perf_counter()
        done = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr)
        if done.returncode:
            hint = f" ({hints[step]})" if hints and step in hints else ""
            raise RuntimeError(f"installing {what}'s venv failed at `{' '.join(command)}` "
                               f"(exit {done.returncode}){hint}; remove {venv} to start again")
        times[step] = time.perf_counter() - step_start
    recorded = {**pins, "install_s": time.perf_counter() - began, "steps_s": times,
                "loadavg_1min": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    stamp.write_text(json.dumps(recorded, indent=2) + "\n")
    return {**recorded, "installed_now": True}
