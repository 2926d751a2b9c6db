"""pdserve loadtest beside a benchmark client pdserve did not write, NVIDIA AIPerf, on the HTTP API.

    python -m bench.outside_client [--json] [--quick] [--url URL] [--concurrency C] [--reps N]
                                   [--only shared-prefix|multi-turn] [--venv DIR] [--model-path PATH]

Not part of `make bench` or `make test`. AIPerf (aiperf==0.13.0) lives in its own virtualenv, which
the first run creates under bench/out/aiperf-venv (pip, about a minute), so it never touches the
project's dependencies. Its tokenizer is the served model's, written as a Hugging Face folder
(tokenizer.json + tokenizer_config.json, what load_tokenizer reads: the tokenizer half of
bench/peer_vllm.py's write_hf_directory, without the 540 MB of weights AIPerf does not need), so
nothing is fetched from the Hugging Face hub.

Cluster: `pdserve up` in a subprocess on free ports (its default 1 prefill + 1 decode worker,
--model-path's model, the embedded SmolLM2-135M-Instruct by default; log in bench/out/), or the
one at --url. Two requests as long as the longest workload's prompts warm it before anything is
measured (see warm_up).

Each workload runs on both tools at the same load: closed loop, --concurrency requests in flight,
the same request count, the same token lengths, streamed chat completions with usage, greedy
(temperature 0) and ignore_eos so every reply is exactly its max tokens long. Each tool is a client
process of its own; the tools take turns (AIPerf first on even reps, pdserve loadtest first on odd
ones), each rep with its own seed so no run finds another run's prompts in the prefix cache.

  shared-prefix  one system prompt of S tokens shared by every request, a user question of Q tokens,
                 O output tokens, N requests.
                 AIPerf --shared-system-prompt-length S --isl Q --osl O --request-count N;
                 loadtest --workload shared-prefix -p system_prompt_tokens=S -p num_prefixes=1
                 -p question_tokens=Q -p output_tokens=O --requests N
  multi-turn     K conversations of T turns, each turn a user message of U tokens after the whole
                 history (the replies included), O output tokens per reply.
                 AIPerf --conversation-num K --conversation-turn-mean T --conversation-turn-stddev 0
                 --isl U --osl O; loadtest --workload multi-turn -p turns=T -p turn_tokens=U
                 -p output_tokens=O --requests K*T

Figures, paired by definition (AIPerf's names on the left; p50 over requests unless said):

  ttft_p50_ms          time_to_first_token             ttft_ms: first content chunk - send
  itl_p50_ms           inter_token_latency, per request tpot_ms: the same formula,
                       (latency - TTFT) / (tokens - 1)  (e2e - TTFT) / (tokens - 1)
  chunk_gap_p50_ms     inter_chunk_latency, every gap   itl_ms: every gap between token messages,
                       between content chunks, pooled   pooled
  output_tokens_per_s  output_token_throughput          throughput_tokens_per_s
  (also e2e_p50_ms, requests_per_s, ttft_mean_ms, chunk_gap_mean_ms, the prompt and output tokens
  per request and the prefix-cache hit fraction, to show both sent the same shape)

NOTE: the two tools' "ITL" are different statistics: AIPerf's is loadtest's TPOT; loadtest's ITL
is AIPerf's inter-chunk latency. The JSON pairs them by formula, never by name. ratio = loadtest ÷
AIPerf; agree = every headline ratio (TTFT, ITL, chunk gap, output tokens/s) within 1 ± 0.15.

Referee: the router's own histograms (pdserve_router_ttft_seconds, _itl_seconds, _e2e_seconds) and
request counter, scraped from BASE/metrics before and after each tool's run, give the server's
mean TTFT, token gap and latency for that run alone. When the tools disagree, the server's figures
say whether the server was slower during one run (the tools are both right) or one client adds time
the other does not (the one further from the server is the one to look at). client_cpu_s is the
user + system CPU of the tool's process tree over its whole run (start-up included), and
client_cores_busy that tree's CPU seconds per second inside the tool's own measurement window
(psutil, sampled every 0.25 s): what the client took from the cores the server runs on.

Where the two workloads still differ, as far as the tools allow:
  - the text: AIPerf draws Shakespeare, loadtest common English words; lengths are counted by the
    same tokenizer (AIPerf's ISL in the model's tokens, loadtest's words one token each), and the
    requests carry the same number of prompt tokens (prompt_tokens_mean shows it), but not the same
    tokens, so the greedy replies differ too;
  - AIPerf sends max_completion_tokens, loadtest max_tokens (pdserve reads either);
  - multi-turn order: AIPerf keeps each conversation on one of its C sessions and sends its turns back
    to back; loadtest sends the turns round robin over the conversations (every first turn, then
    every second turn...), each after its previous turn's reply. Same requests, same histories
    length by length, another interleaving;
  - throughput's clock: AIPerf divides by its profiling phase's duration, loadtest by the span from
    its first send to its last reply (both after their own start-up).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import (
    bench_parser,
    check_least,
    ensure_venv,
    environment,
    format_table,
    progress,
    run_timed,
    warn_if_busy,
)

ROOT = Path(__file__).resolve().parents[1]  # the processes' working directory: `-m loadtest` is ours
OUT = ROOT / "bench" / "out"
AIPERF_VERSION = "0.13.0"
AGREEMENT = 0.15  # the issue's: the tools agree when loadtest ÷ AIPerf is within 1 ± this
HEADLINES = ("ttft_p50_ms", "itl_p50_ms", "chunk_gap_p50_ms", "output_tokens_per_s")
START_TIMEOUT_S = 600
RUN_TIMEOUT_S = 1800
SERVER_HISTOGRAMS = {"ttft_mean_ms": "pdserve_router_ttft_seconds",
                     "itl_mean_ms": "pdserve_router_itl_seconds",
                     "e2e_mean_ms": "pdserve_router_e2e_seconds"}


# --- the workloads -------------------------------------------------------------------------------
@dataclass(frozen=True)
class SharedPrefix:
    system_prompt_tokens: int = 256
    question_tokens: int = 32
    output_tokens: int = 32
    requests: int = 16
    name = "shared-prefix"

    @property
    def prompt_tokens(self) -> int:
        return self.system_prompt_tokens + self.question_tokens

    def aiperf_flags(self) -> list[str]:
        return ["--shared-system-prompt-length", str(self.system_prompt_tokens), "--isl",
                str(self.question_tokens), "--isl-stddev", "0", "--osl", str(self.output_tokens),
                "--request-count", str(self.requests)]

    def loadtest_flags(self) -> list[str]:
        return ["--workload", self.name, "-p", f"system_prompt_tokens={self.system_prompt_tokens}",
                "-p", "num_prefixes=1", "-p", f"question_tokens={self.question_tokens}",
                "-p", f"output_tokens={self.output_tokens}", "--requests", str(self.requests)]


@dataclass(frozen=True)
class MultiTurn:
    conversations: int = 4
    turns: int = 4
    turn_tokens: int = 32
    output_tokens: int = 32
    name = "multi-turn"

    @property
    def prompt_tokens(self) -> int:
        return self.turns * (self.turn_tokens + self.output_tokens)  # the last turn's, history included

    @property
    def requests(self) -> int:
        return self.conversations * self.turns

    def aiperf_flags(self) -> list[str]:
        return ["--conversation-num", str(self.conversations), "--conversation-turn-mean", str(self.turns),
                "--conversation-turn-stddev", "0", "--conversation-turn-delay-mean", "0",
                "--isl", str(self.turn_tokens), "--isl-stddev", "0", "--osl", str(self.output_tokens)]

    def loadtest_flags(self) -> list[str]:
        return ["--workload", self.name, "-p", f"turns={self.turns}", "-p", f"turn_tokens={self.turn_tokens}",
                "-p", f"output_tokens={self.output_tokens}", "--requests", str(self.requests)]


Workload = SharedPrefix | MultiTurn
FULL = (SharedPrefix(), MultiTurn())
QUICK = (SharedPrefix(system_prompt_tokens=128, question_tokens=16, output_tokens=16, requests=8),
         MultiTurn(conversations=4, turns=2, turn_tokens=16, output_tokens=16))


@dataclass(frozen=True)
class Target:
    """Where both tools send, and as whom."""

    url: str  # base URL, http://HOST:PORT
    model: str
    concurrency: int
    token_env: str | None = None  # the environment variable that holds the API token


# --- the two tools' command lines (pure) ----------------------------------------------------------
def aiperf_command(aiperf: Path, target: Target, tokenizer: Path, workload: Workload, seed: int,
                   out_dir: Path) -> list[str]:
    # NOTE: the token goes on AIPerf's command line: 0.13 does not expand ${NAME} in --api-key there
    # (it sent the text as is), reads OPENAI_API_KEY only to refill a key a config file named, and a
    # config file must then hold the whole benchmark.
    token = ["--api-key", os.environ[target.token_env]] if target.token_env else []
    return [str(aiperf), "profile", "--model", target.model, "--url", target.url, "--endpoint-type", "chat",
            "--streaming", "--tokenizer", str(tokenizer), *workload.aiperf_flags(),
            "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
            "--use-server-token-count", "--concurrency", str(target.concurrency),
            "--random-seed", str(seed), *token,
            "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry", "--artifact-dir", str(out_dir)]


def loadtest_command(target: Target, workload: Workload, seed: int, out_dir: Path) -> list[str]:
    token = ["--api-token-env", target.token_env] if target.token_env else []
    return [sys.executable, "-m", "loadtest", "--api", "openai", "--url", target.url, "--model", target.model,
            *workload.loadtest_flags(), "--concurrency", str(target.concurrency), "--seed", str(seed),
            "--temperature", "0", "--ignore-eos", *token, "--out", str(out_dir), "--no-progress"]


# --- figures, read from each tool's own export (pure) ---------------------------------------------
def aiperf_figures(export: Mapping[str, Any]) -> dict[str, Any]:
    """From profile_export_aiperf.json (latencies there are already in ms)."""
    stat = lambda key, which: (export.get(key) or {}).get(which)
    cache_pct = stat("overall_usage_prompt_cache_read_pct", "avg")
    completed = stat("request_count", "avg")
    return {"ttft_p50_ms": stat("time_to_first_token", "p50"),
            "ttft_mean_ms": stat("time_to_first_token", "avg"),
            "itl_p50_ms": stat("inter_token_latency", "p50"),
            "chunk_gap_p50_ms": stat("inter_chunk_latency", "p50"),
            "chunk_gap_mean_ms": stat("inter_chunk_latency", "avg"),
            "e2e_p50_ms": stat("request_latency", "p50"),
            "output_tokens_per_s": stat("output_token_throughput", "avg"),
            "requests_per_s": stat("request_throughput", "avg"),
            "prompt_tokens_mean": stat("usage_prompt_tokens", "avg") or stat("input_sequence_length", "avg"),
            "output_tokens_mean": stat("output_sequence_length", "avg"),
            "cached_fraction": cache_pct / 100 if cache_pct is not None else None,
            "completed": int(completed) if completed is not None else 0,
            "failed": sum(int(e.get("count", 0)) for e in export.get("error_summary") or []),
            "duration_s": stat("benchmark_duration", "avg")}


def loadtest_figures(report: Mapping[str, Any]) -> dict[str, Any]:
    """From pdserve loadtest's report.json."""
    return {"ttft_p50_ms": report["ttft_ms"]["p50"], "ttft_mean_ms": report["ttft_ms"]["mean"],
            "itl_p50_ms": report["tpot_ms"]["p50"], "chunk_gap_p50_ms": report["itl_ms"]["p50"],
            "chunk_gap_mean_ms": report["itl_ms"]["mean"], "e2e_p50_ms": report["e2e_ms"]["p50"],
            "output_tokens_per_s": report["throughput_tokens_per_s"],
            "requests_per_s": report["requests_per_s"],
            "prompt_tokens_mean": report["prompt_tokens_per_request"]["mean"],
            "output_tokens_mean": report["output_tokens_per_request"]["mean"],
            "cached_fraction": report["prefix_hit_rate"], "completed": report["counts"]["completed"],
            "failed": report["counts"]["failed"], "duration_s": report["duration_s"]}


def histogram_totals(exposition: str) -> dict[str, float]:
    """The _sum and _count of the router's latency histograms and its finished-request count."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = set(SERVER_HISTOGRAMS.values())
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            base = sample.name.removesuffix("_sum").removesuffix("_count")
            if base in wanted and sample.name != base:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
            elif sample.name == "pdserve_router_requests_total":
                out["requests"] = out.get("requests", 0.0) + sample.value
    return out


def server_figures(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float | None]:
    """The router's mean TTFT, token gap and latency over what it served between the two scrapes."""
    out: dict[str, float | None] = {"requests": after.get("requests", 0.0) - before.get("requests", 0.0)}
    for key, name in SERVER_HISTOGRAMS.items():
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
        out[key] = 1e3 * total / count if count > 0 else None
    return out


def median_figures(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each numeric figure's median over reps (None when a rep lacks it)."""
    out: dict[str, Any] = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        numbers = all(isinstance(v, int | float) for v in values)
        out[key] = statistics.median(values) if numbers else (values[0] if len(values) == 1 else None)
    return out


def compare(aiperf: Mapping[str, Any], loadtest: Mapping[str, Any]) -> dict[str, Any]:
    """loadtest ÷ AIPerf for every figure both have; agree when each headline is within 1 ± AGREEMENT."""
    number = lambda x: isinstance(x, int | float) and not isinstance(x, bool)
    ratios = {k: round(loadtest[k] / aiperf[k], 4) for k in aiperf
              if number(aiperf[k]) and number(loadtest.get(k)) and aiperf[k]}
    misses = [k for k in HEADLINES if k not in ratios or abs(ratios[k] - 1) > AGREEMENT]
    return {"ratio_loadtest_over_aiperf": ratios, "agree": not misses, "disagreeing": misses}


# --- the processes ----------------------------------------------------------------------------------
def ensure_aiperf_venv(venv: Path) -> dict[str, Any]:
    py = str(venv / "bin" / "python")
    steps = {"venv": [sys.executable, "-m", "venv", str(venv)],
             "aiperf": [py, "-m", "pip", "install", f"aiperf=={AIPERF_VERSION}"]}
    return ensure_venv(venv, steps, {"aiperf": AIPERF_VERSION}, "AIPerf",
                       hints={"aiperf": "check the pin with `pip index versions aiperf`"})


def write_tokenizer(model_path: str | None, directory: Path) -> Path:
    """The served model's tokenizer as a Hugging Face folder (AIPerf's --tokenizer)."""
    from pdserve.engine.weights import load_tokenizer

    load_tokenizer(model_path).save(directory)
    return directory


@contextlib.contextmanager
def pdserve_up(model_path: str | None, log_path: Path) -> Iterator[str]:
    """`pdserve up` on free ports until the block ends (SIGTERM, then SIGKILL); yields the HTTP base URL."""
    from deploy.redis_server import free_port

    port, http_port = free_port(), free_port()
    command = [sys.executable, "-m", "deploy.cli", "up", "--port", str(port), "--http-port", str(http_port),
               "--no-sample", *(["--model", model_path] if model_path else [])]
    progress(f"starting `pdserve up` (log: {log_path})")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    serving = threading.Event()

    def read() -> None:  # the one owner of the log file, open while `pdserve up` writes
        assert proc.stdout is not None
        with open(log_path, "w") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith("serving on"):
                    serving.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not serving.wait(1.0):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`pdserve up` did not start (exit {proc.poll()}); see {log_path}")
        yield f"http://127.0.0.1:{http_port}"
    finally:
        _stop(proc)
        reader.join(timeout=10)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, which `pdserve up` handles as Ctrl-C. NOTE: not SIGINT: a shell without job control
    starts background commands with SIGINT ignored, and their children inherit that."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def http_json(url: str, body: Mapping[str, Any] | None = None, token: str | None = None) -> Any:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    data = json.dumps(body).encode() if body is not None else None
    with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=300) as r:
        return json.loads(r.read())


def warm_up(url: str, model: str, token: str | None, prompt_tokens: int, seed: int) -> None:
    """Two requests at once with prompts as long as the longest workload's, so the first tool measured
    does not pay for the cluster's first long prefills on the prefill worker and the first KV
    transfers (in one run without this, the first tool's two cold requests took 2.5 s, the second
    tool's 1.5 s), with text neither tool sends."""
    from concurrent.futures import ThreadPoolExecutor

    from loadtest.workloads import words

    rng = random.Random(f"{seed}/warm-up")
    bodies = [{"model": model, "max_tokens": 4,
               "messages": [{"role": "user", "content": words(rng, prompt_tokens)}]} for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda body: http_json(f"{url}/v1/chat/completions", body, token=token), bodies))


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        return histogram_totals(response.read().decode())


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_in_window(samples: Sequence[tuple[float, float]], start: float, end: float) -> float | None:
    """CPU seconds spent between start and end, from (time, cumulative CPU seconds) samples, linear
    between samples; None when the samples do not cover the window."""
    if len(samples) < 2 or start < samples[0][0] or end > samples[-1][0] or end <= start:
        return None

    def at(t: float) -> float:
        for (t0, c0), (t1, c1) in zip(samples, samples[1:]):
            if t0 <= t <= t1:
                return c0 if t1 == t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)
        return samples[-1][1]

    return at(end) - at(start)


class TreeCpu:
    """The cumulative CPU seconds of a process and its descendants, sampled on a thread (psutil).
    NOTE: a process keeps its last reading once it exits, so the sum never goes back."""

    def __init__(self, pid: int, interval_s: float = 0.25) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.samples: list[tuple[float, float]] = []
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(self.interval_s):
            try:
                root = psutil.Process(self.pid)
                for proc in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        times = proc.cpu_times()
                        self._last[proc.pid] = times.user + times.system
            except psutil.Error:
                pass
            self.samples.append((time.time(), sum(self._last.values())))

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        self._thread.join()
        return self.samples


def run_tool(tool: str, command: list[str], out_dir: Path, url: str) -> dict[str, Any]:
    """One tool's run: its own process, timed, CPU-sampled and scraped around; its figures from its
    own export, and the CPU its process tree used while it measured (client_cores_busy)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / f"{tool}.log"
    before, cpu, started = scrape(url), children_cpu_s(), time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        sampler = TreeCpu(proc.pid)
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
            samples = sampler.stop()
    wall, cpu_s, after = time.perf_counter() - started, children_cpu_s() - cpu, scrape(url)
    if code:
        raise RuntimeError(f"{tool} failed (exit {code}); its output is in {log}")
    if tool == "aiperf":
        export = json.loads((out_dir / "profile_export_aiperf.json").read_text())
        figures = aiperf_figures(export)
        window = (datetime.fromisoformat(export["start_time"]).timestamp(),
                  datetime.fromisoformat(export["end_time"]).timestamp())
    else:
        report = json.loads((out_dir / "report.json").read_text())
        figures = loadtest_figures(report)
        window = (report["started_unix_s"], report["started_unix_s"] + report["duration_s"])
    busy = cpu_in_window(samples, *window)
    return {**figures, "server": server_figures(before, after), "client_cpu_s": round(cpu_s, 2),
            "client_cores_busy": round(busy / (window[1] - window[0]), 3) if busy is not None else None,
            "wall_s": round(wall, 2)}


def run_workload(workload: Workload, target: Target, aiperf: Path, tokenizer: Path, args: argparse.Namespace,
                 out: Path) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"aiperf": [], "loadtest": []}
    for rep in range(args.reps):
        seed = args.seed + rep
        order = ("aiperf", "loadtest") if rep % 2 == 0 else ("loadtest", "aiperf")
        for tool in order:
            out_dir = out / workload.name / f"{tool}-rep{rep}"
            command = (aiperf_command(aiperf, target, tokenizer, workload, seed, out_dir) if tool == "aiperf"
                       else loadtest_command(target, workload, seed, out_dir))
            progress(f"{workload.name} rep {rep + 1}/{args.reps}: {tool}")
            runs[tool].append(run_tool(tool, command, out_dir, target.url))
    figures = {tool: median_figures([{k: v for k, v in r.items() if k != "server"} for r in rs])
               for tool, rs in runs.items()}
    server = {tool: median_figures([r["server"] for r in rs]) for tool, rs in runs.items()}
    return {"workload": {"name": workload.name, **asdict(workload), "requests": workload.requests},
            "aiperf": figures["aiperf"], "loadtest": figures["loadtest"], "server": server,
            **compare(figures["aiperf"], figures["loadtest"]), "reps": runs}


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_at_start = warn_if_busy(len(os.sched_getaffinity(0)))
    install = ensure_aiperf_venv(args.venv)
    tokenizer = write_tokenizer(args.model_path, OUT / "outside-client-tokenizer")
    out = OUT / "outside_client"
    workloads = [w for w in (QUICK if args.quick else FULL) if args.only in (None, w.name)]
    token = os.environ.get(args.api_token_env) if args.api_token_env else None
    with contextlib.ExitStack() as stack:
        url = args.url.rstrip("/").removesuffix("/v1") if args.url else stack.enter_context(
            pdserve_up(args.model_path, OUT / "outside_client_up.log"))
        model = http_json(f"{url}/v1/models", token=token)["data"][0]["id"]
        target = Target(url, model, args.concurrency, args.api_token_env)
        warm_up(url, model, token, max(w.prompt_tokens for w in workloads), args.seed)
        results = {w.name: run_workload(w, target, args.venv / "bin" / "aiperf", tokenizer, args, out)
                   for w in workloads}
    return {"workloads": results, "agree": all(r["agree"] for r in results.values()),
            "agreement": f"every headline ratio within 1 ± {AGREEMENT}", "headlines": list(HEADLINES),
            "concurrency": args.concurrency, "reps": args.reps, "seed": args.seed, "quick": args.quick,
            "url": url if args.url else "pdserve up (started here)", "model": model,
            "aiperf": {"version": AIPERF_VERSION, "install_s": install.get("install_s"),
                       "installed_now": install["installed_now"]},
            "artifacts": str(out), "environment": {**_environment(), "loadavg_at_start": load_at_start}}


def _environment() -> dict[str, Any]:
    """bench.common's record of the machine, less its torch thread count (nothing here sets one)."""
    return {k: v for k, v in environment(0).items() if k != "threads"}


def report(r: dict[str, Any]) -> str:
    lines = [f"AIPerf {r['aiperf']['version']} and pdserve loadtest, concurrency {r['concurrency']}, "
             f"{r['reps']} rep(s), model {r['model']}; load average at start "
             f"{r['environment']['loadavg_at_start']:.2f}"]
    keys = (*HEADLINES, "e2e_p50_ms", "requests_per_s", "prompt_tokens_mean", "output_tokens_mean",
            "cached_fraction", "client_cpu_s", "client_cores_busy")
    for name, w in r["workloads"].items():
        ratios = w["ratio_loadtest_over_aiperf"]
        rows = [[k, w["aiperf"].get(k), w["loadtest"].get(k), ratios.get(k, "-")] for k in keys]
        for k in ("ttft_mean_ms", "itl_mean_ms"):
            rows.append([f"server {k}", w["server"]["aiperf"].get(k), w["server"]["loadtest"].get(k), "-"])
        verdict = "agree" if w["agree"] else f"DISAGREE on {', '.join(w['disagreeing'])}"
        lines += ["", f"{name} ({w['workload']['requests']} requests): {verdict}",
                  format_table(["figure", "AIPerf", "loadtest", "loadtest/AIPerf"], rows)]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bench_parser("python -m bench.outside_client", __doc__)
    p.add_argument("--url", help="the OpenAI-compatible HTTP API to measure, e.g. http://127.0.0.1:8000 "
                                 "(default: start `pdserve up` on free ports for the run and stop it after)")
    p.add_argument("--model-path", help="the model `pdserve up` serves and whose tokenizer AIPerf counts "
                                        "with (default: the embedded SmolLM2-135M-Instruct); with --url, "
                                        "give the served model's so AIPerf counts tokens as it does")
    p.add_argument("--concurrency", type=int, default=2,
                   help="requests in flight, both tools, closed loop (default: %(default)s)")
    p.add_argument("--reps", type=int, default=1,
                   help="runs of each tool per workload, taking turns; medians are reported (default: "
                        "%(default)s)")
    p.add_argument("--only", choices=[w.name for w in FULL], help="run one workload (default: both)")
    p.add_argument("--quick", action="store_true",
                   help="smaller workloads: shared-prefix 8 requests of 128 + 16 prompt and 16 output "
                        "tokens; multi-turn 4 conversations of 2 turns of 16 tokens, 16 output tokens "
                        "(default: shared-prefix 16 requests of 256 + 32 and 32; multi-turn 4 x 4 turns "
                        "of 32 and 32)")
    p.add_argument("--seed", type=int, default=int(time.time()) % 100_000,
                   help="seed of both tools' prompts on the first rep, +1 each rep (default: from the clock, "
                        "so no run meets an earlier run's prompts in the prefix cache; the JSON records it)")
    p.add_argument("--api-token-env", metavar="NAME",
                   help="the environment variable holding the API token, for a --url that wants one "
                        "(loadtest --api-token-env NAME; AIPerf --api-key TOKEN, which puts the token on its "
                        "command line for the run: AIPerf 0.13 takes it no other way short of a whole "
                        "config file)")
    p.add_argument("--venv", type=Path, default=OUT / "aiperf-venv",
                   help="AIPerf's virtualenv, created there on first use (default: bench/out/aiperf-venv)")
    args = check_least(p, p.parse_args(argv), {"concurrency": 1, "reps": 1})
    if args.api_token_env and args.api_token_env not in os.environ:
        p.error(f"--api-token-env {args.api_token_env}: that variable is not set")
    return args


def main(argv: list[str] | None = None) -> None:
    run_timed(run, report, parse_args(argv))


if __name__ == "__main__":
    main()
