"""vLLM's side of bench/peer_vllm.py: run by the python of vLLM's own virtualenv, never imported.

    <vllm-venv>/bin/python bench/vllm_driver.py '{"model": DIR, "max_model_len": 4096, ...}'

It imports only vLLM and the standard library. Lifecycle:

    start   build vllm.LLM (spawns EngineCore, which spawns the CPU worker; the first start
            compiles the model), then print one ready reply: start seconds, versions, and
            what the worker was given (OMP_NUM_THREADS, its CPUs)
    serve   read one JSON command per stdin line, answer one reply line on stdout:
              {"op": "stream", "prompt": [ids], "max_tokens": n}   token ids + arrival times
              {"op": "generate", "prompts": [[ids]], "max_tokens": [n]}   one LLM.generate call
              {"op": "reset_prefix_cache"}
              {"op": "worker_threads"}   the worker's OS threads and their CPU seconds
              {"op": "quit"}
    stop    on quit or end of stdin

NOTE: vLLM logs to stdout, and so do the processes it spawns, so a reply is the one line that
starts with REPLY_MARKER; the bench treats every other line as log. Timings are taken here,
around vLLM's calls, so the pipe to the bench costs nothing that is measured.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPLY_MARKER = "@@vllm-driver "


def reply(message: dict[str, Any]) -> None:
    sys.stdout.write(REPLY_MARKER + json.dumps(message) + "\n")
    sys.stdout.flush()


# --- the worker process, seen through /proc ---------------------------------------------------
def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def process_environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def worker_pid() -> int | None:
    """The CPU worker: the descendant that vLLM started with OMP_NUM_THREADS set for its binding."""
    for pid in descendants(os.getpid()):
        env = process_environ(pid)
        if "OMP_NUM_THREADS" in env and ("OMP_PLACES" in env or "KMP_AFFINITY" in env
                                         or "GOMP_CPU_AFFINITY" in env):
            return pid
    return None


def cpus_allowed(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return "?"


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each OS thread of pid, by thread id."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[task.name] = (int(fields[11]) + int(fields[12])) / ticks
    return out


# --- commands ---------------------------------------------------------------------------------
def greedy(max_tokens: int, kind: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                          output_kind=kind)


def stream(llm: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One request through the engine's add_request/step loop, so every token has its time."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    start = time.perf_counter()
    params = greedy(max_tokens, RequestOutputKind.DELTA)  # DELTA: an output per step, not one at the end
    engine.add_request("stream", TokensPrompt(prompt_token_ids=prompt), params)
    tokens: list[int] = []
    stamps: list[float] = []
    cached = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            new = list(out.outputs[0].token_ids)
            tokens.extend(new)
            stamps.extend([time.perf_counter() - start] * len(new))
            if out.num_cached_tokens is not None:
                cached = out.num_cached_tokens
    return {"tokens": tokens, "stamps": stamps, "cached_tokens": cached}


def generate(llm: Any, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [greedy(n, RequestOutputKind.FINAL_ONLY) for n in max_tokens]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "cached_tokens": [o.num_cached_tokens for o in outputs]}


def serve(llm: Any) -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        op = command.get("op")
        try:
            if op == "quit":
                reply({"ok": True})
                return
            if op == "stream":
                reply(stream(llm, command["prompt"], command["max_tokens"]))
            elif op == "generate":
                reply(generate(llm, command["prompts"], command["max_tokens"]))
            elif op == "reset_prefix_cache":
                reply({"ok": bool(llm.reset_prefix_cache())})
            elif op == "worker_threads":
                pid = worker_pid()
                reply({"pid": pid, "threads": thread_cpu_seconds(pid) if pid else {}})
            else:
                reply({"error": f"unknown op {op!r}; expected stream, generate, reset_prefix_cache, "
                                "worker_threads or quit"})
        except Exception as e:  # a failed command is answered, not fatal: the bench decides
            reply({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})


def start(config: dict[str, Any]) -> Any:
    import torch
    import vllm
    from vllm import LLM

    began = time.perf_counter()
    llm = LLM(model=config["model"], dtype="float32", max_model_len=config["max_model_len"],
              max_num_batched_tokens=config["max_num_batched_tokens"], max_num_seqs=config["max_num_seqs"],
              enable_prefix_caching=True, seed=config.get("seed", 0))
    start_s = time.perf_counter() - began
    pid = worker_pid()
    env = process_environ(pid) if pid else {}
    reply({"ready": True, "start_s": start_s, "vllm_version": vllm.__version__, "torch": torch.__version__,
           "worker_pid": pid, "worker_omp_num_threads": env.get("OMP_NUM_THREADS"),
           "worker_omp_places": env.get("OMP_PLACES"),
           "worker_cpus_allowed": cpus_allowed(pid) if pid else None,
           "driver_cpus_allowed": cpus_allowed(os.getpid()),
           "vllm_cpu_omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "(unset: auto)"),
           "vllm_cpu_kvcache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE")})
    return llm


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: vllm_driver.py '<JSON config: model, max_model_len, max_num_batched_tokens, "
                 "max_num_seqs>'")
    try:
        llm = start(json.loads(sys.argv[1]))
    except Exception as e:
        reply({"error": f"vLLM did not start: {type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        sys.exit(1)
    serve(llm)


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this file
    main()
