"""pdserve's engine against Hugging Face transformers: same weights, same threads, one run.

    python -m bench.engine [--json] [--quick] [--threads N] [--reps N] [--model NAME|GGUF]

Ours is LLMEngine over load_model(model) (SmolLM2-135M-Instruct by default; `--model gemma3-270m`
for Gemma 3 270M; dequantised to fp32); theirs is transformers' AutoModelForCausalLM on the same
GGUF, fp32, sdpa.
Phases, in order (decode first: it is also the correctness check, and fails fast):

  peak        fp32 torch.mm FLOP/s on this machine (for prefill_fraction_of_peak), and the
              memory bandwidth of a large copy (for decode_fraction_of_bandwidth)
  decode      batch 1, greedy, same chat prompt, exactly N new tokens on both sides;
              asserts that both produce the same tokens
  prefill     one prompt of L tokens; ours: add_request -> first token, prefix cache
              reset before every rep; theirs: model(ids) and model(ids, logits_to_keep=1)
  warm TTFT   an L-token prompt whose first L-128 tokens a previous request shared,
              against the same prompt with the cache reset; and a 14-token suffix after
              those L-128 cached tokens, in decode steps of the decode phase
  concurrent  R requests of mixed lengths; ours: all submitted at once (continuous
              batching); theirs: generate() over static left-padded batches

Within a phase the two sides alternate rep by rep, so drift on a noisy machine hits
both. Reported figures are medians over reps after a warm-up; ratios are ours ÷ theirs
(for warm TTFT: warm ÷ cold), so above 1 means ours is faster except for TTFT.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    add_kernel_flags,
    add_threads_flag,
    bench_parser,
    check_least,
    copy_bandwidth,
    environment,
    format_table,
    kernel_settings,
    median,
    peak_matmul_flops,
    progress,
    ratio,
    run_timed,
    set_threads,
    timed,
    warn_if_busy,
)
from pdserve.units import ceil_div

DECODE_MESSAGES = [{"role": "user", "content":
                    "Write a long, detailed story about a lighthouse keeper who finds a message "
                    "in a bottle, and what happens over the following year."}]


@dataclass(frozen=True)
class Sizes:
    """What each phase measures. FULL gives the documented keys; QUICK is a smoke run."""

    prefill_lengths: tuple[int, ...] = (512, 2048)
    decode_new_tokens: int = 128
    concurrent_requests: int = 32
    concurrent_prompt_range: tuple[int, int] = (32, 512)
    concurrent_output_range: tuple[int, int] = (16, 128)
    peer_batch_sizes: tuple[int, ...] = (8, 16)
    warm_prompt_tokens: int = 2048
    warm_cached_tokens: int = 1920
    reps: int = 3
    concurrent_reps: int = 2  # each rep runs the 32 requests three times (ours, batch 8, batch 16)
    block_size: int = 16


FULL = Sizes()
QUICK = Sizes(prefill_lengths=(128, 512), decode_new_tokens=16, concurrent_requests=8,
              concurrent_prompt_range=(16, 64), concurrent_output_range=(4, 16), peer_batch_sizes=(4, 8),
              warm_prompt_tokens=512, warm_cached_tokens=384, reps=1, concurrent_reps=1)

TARGETS = {"prefill": 1.0, "decode": 2.0, "decode_bandwidth": 0.6, "concurrent": 2.5, "warm_ttft": 0.08,
           "warm_suffix_steps": 2.0, "prefill_peak": 0.6}
SMOLLM2_VOCAB = 49152
WARM_SUFFIX_TOKENS = 14  # the cluster trace that showed 294 ms for 14 new tokens after 544 cached


# --- the two sides ----------------------------------------------------------------------------
class Ours:
    """LLMEngine, driven one step at a time so that token timestamps are exact."""

    def __init__(self, loaded: Any, num_blocks: int, block_size: int, threads: int, *,
                 linear_kernel: str = "auto", attention_kernel: str = "auto",
                 pointwise_kernel: str = "auto", retain_freed_memory: bool = True) -> None:
        from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
        from pdserve.engine.llm_engine import LLMEngine
        cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_dtype="float32",
                            enable_prefix_caching=True)
        scheduler = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64)
        config = EngineConfig(cache=cache, scheduler=scheduler, device="cpu", num_threads=threads,
                              linear_kernel=linear_kernel, attention_kernel=attention_kernel,
                              pointwise_kernel=pointwise_kernel, retain_freed_memory=retain_freed_memory)
        self.engine = LLMEngine(loaded, config)
        self.vocab = loaded.tokenizer.vocab_size  # the prompts' token ids stay below it

    @staticmethod
    def greedy(max_tokens: int) -> Any:
        from pdserve.engine.sequence import SamplingParams
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def stream(self, ids: list[int], new_tokens: int) -> tuple[list[int], list[float], Any]:
        """Token ids, their arrival times (seconds since add_request) and the final usage."""
        start = time.perf_counter()
        rid = self.engine.add_request(ids, self.greedy(new_tokens), detokenize=False)
        tokens: list[int] = []
        stamps: list[float] = []
        usage = None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id == rid:
                    tokens.extend(out.new_token_ids)
                    stamps.extend([time.perf_counter() - start] * len(out.new_token_ids))
                    usage = out.usage
        return tokens, stamps, usage

    def ttft(self, ids: list[int]) -> tuple[float, Any]:
        """Seconds from add_request to the first token of a max_tokens=1 request, and its usage."""
        _, stamps, usage = self.stream(ids, 1)
        return stamps[0], usage

    def generate(self, prompts: list[list[int]], new_tokens: list[int]) -> list[list[int]]:
        results = self.engine.generate(prompts, [self.greedy(n) for n in new_tokens], detokenize=False)
        return [r.token_ids for r in results]

    def reset(self) -> None:
        leaked = self.engine.leaked_blocks()
        assert not leaked, f"engine leaked blocks {leaked[:8]} between benchmark runs"
        self.engine.pool.reset_cache()


class Theirs:
    """transformers' model of the same family on the same GGUF."""

    def __init__(self, gguf_path: Path) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        self.model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                          dtype=torch.float32).eval()
        self.pad_id = self.model.generation_config.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.model.config.eos_token_id

    @torch.inference_mode()
    def forward(self, ids: list[int], last_logits_only: bool) -> None:
        x = torch.tensor([ids])
        self.model(x, logits_to_keep=1) if last_logits_only else self.model(x)

    @torch.inference_mode()
    def stream(self, ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
        stamps = _Stamps()
        mask = torch.ones(1, len(ids), dtype=torch.long)
        out = self.model.generate(torch.tensor([ids]), attention_mask=mask, do_sample=False,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  pad_token_id=self.pad_id, streamer=stamps)
        return out[0, len(ids):].tolist(), stamps.since_start()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: list[int], batch_size: int) -> list[list[int]]:
        """Static batches in arrival order; each runs until its longest request is done."""
        results: list[list[int]] = []
        for b in range(0, len(prompts), batch_size):
            batch, wants = prompts[b:b + batch_size], new_tokens[b:b + batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            steps = max(wants)
            out = self.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=steps,
                                      min_new_tokens=steps, pad_token_id=self.pad_id)
            results.extend(row[width:width + n].tolist() for row, n in zip(out, wants))
        return results


class _Stamps:
    """A generate() streamer that records when each new token arrives (the first put is the prompt)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.extend([time.perf_counter()] * value.numel())

    def end(self) -> None:
        pass

    def since_start(self) -> list[float]:
        return [t - self.start for t in self.times]


# --- phases --------------------------------------------------------------------------------
def decode_tokens_per_s(stamps: list[float]) -> float:
    """(new tokens - 1) ÷ (time of last token - time of first token): prefill excluded."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def bench_decode(ours: Ours, theirs: Theirs, prompt: list[int], sizes: Sizes) -> dict[str, Any]:
    n = sizes.decode_new_tokens
    rates: dict[str, list[float]] = {"ours": [], "theirs": []}
    e2e: dict[str, list[float]] = {"ours": [], "theirs": []}
    ours_tokens = theirs_tokens = None
    for rep in range(sizes.reps + 1):  # rep 0 is the warm-up
        progress(f"decode batch 1: rep {rep}/{sizes.reps} ({n} new tokens, prompt {len(prompt)} tokens)")
        ours.reset()
        ours_tokens, o_stamps, _ = ours.stream(prompt, n)
        theirs_tokens, t_stamps = theirs.stream(prompt, n)
        assert len(ours_tokens) == len(theirs_tokens) == n, (len(ours_tokens), len(theirs_tokens))
        if rep:
            for side, stamps in (("ours", o_stamps), ("theirs", t_stamps)):
                rates[side].append(decode_tokens_per_s(stamps))
                e2e[side].append(n / stamps[-1])
    first_diff = next((i for i, (a, b) in enumerate(zip(ours_tokens, theirs_tokens)) if a != b), None)
    assert first_diff is None, (
        f"greedy tokens differ from transformers' at new token {first_diff}: "
        f"ours {ours_tokens[first_diff:first_diff + 8]} vs theirs {theirs_tokens[first_diff:first_diff + 8]}")
    o, t = median(rates["ours"]), median(rates["theirs"])
    return {"decode_ratio_batch1": ratio(o, t),
            "decode_tokens_per_s_ours": o, "decode_tokens_per_s_theirs": t,
            "decode_e2e_tokens_per_s_ours": median(e2e["ours"]),
            "decode_e2e_tokens_per_s_theirs": median(e2e["theirs"]),
            "decode_greedy_tokens_match": True, "decode_new_tokens": n, "decode_prompt_tokens": len(prompt)}


def bench_prefill(ours: Ours, theirs: Theirs, length: int, sizes: Sizes,
                  rng: random.Random) -> dict[str, Any]:
    prompt = random_prompt(rng, length, ours.vocab)
    seconds: dict[str, list[float]] = {"ours": [], "theirs": [], "theirs_keep1": []}
    for rep in range(sizes.reps + 1):
        progress(f"prefill {length:,} tokens: rep {rep}/{sizes.reps}")
        ours.reset()
        s_ours, usage = ours.ttft(prompt)
        assert usage.cached_tokens == 0, f"cold prefill hit the prefix cache ({usage.cached_tokens} tokens)"
        s_theirs, _ = timed(lambda: theirs.forward(prompt, last_logits_only=False))
        s_keep1, _ = timed(lambda: theirs.forward(prompt, last_logits_only=True))
        if rep:
            for side, s in (("ours", s_ours), ("theirs", s_theirs), ("theirs_keep1", s_keep1)):
                seconds[side].append(s)
    tps = {side: length / median(s) for side, s in seconds.items()}
    return {f"prefill_ratio_{length}": ratio(tps["ours"], tps["theirs"]),
            f"prefill_ratio_keep1_{length}": ratio(tps["ours"], tps["theirs_keep1"]),
            f"prefill_tokens_per_s_ours_{length}": tps["ours"],
            f"prefill_tokens_per_s_theirs_{length}": tps["theirs"],
            f"prefill_tokens_per_s_theirs_keep1_{length}": tps["theirs_keep1"]}


def bench_warm_ttft(ours: Ours, sizes: Sizes, rng: random.Random) -> dict[str, Any]:
    total, cached = sizes.warm_prompt_tokens, sizes.warm_cached_tokens
    assert cached % sizes.block_size == 0 and cached < total
    prompt = random_prompt(rng, total, ours.vocab)
    # The primer shares exactly the first `cached` tokens, then diverges for more than a block.
    primer = prompt[:cached] + random_prompt(rng, 2 * sizes.block_size, ours.vocab)
    suffixed = prompt[:cached] + random_prompt(rng, WARM_SUFFIX_TOKENS, ours.vocab)
    seconds: dict[str, list[float]] = {"cold": [], "warm": [], "suffix": []}
    for rep in range(sizes.reps + 1):
        progress(f"TTFT {total:,} tokens, cold vs {cached:,} cached: rep {rep}/{sizes.reps}")
        ours.reset()
        s_cold, usage = ours.ttft(prompt)
        assert usage.cached_tokens == 0, usage
        ours.reset()
        ours.ttft(primer)
        s_warm, usage = ours.ttft(prompt)
        assert usage.cached_tokens == cached, f"expected {cached} cached tokens, got {usage.cached_tokens}"
        s_suffix, usage = ours.ttft(suffixed)
        assert usage.cached_tokens == cached, f"suffix: expected {cached} cached, got {usage.cached_tokens}"
        if rep:
            for key, s in (("cold", s_cold), ("warm", s_warm), ("suffix", s_suffix)):
                seconds[key].append(s)
    cold, warm, suffix = (median(seconds[k]) for k in ("cold", "warm", "suffix"))
    return {"warm_ttft_ratio": warm / cold, "ttft_cold_s": cold, "ttft_warm_s": warm,
            "warm_prompt_tokens": total, "warm_cached_tokens": cached,
            "warm_suffix_tokens": WARM_SUFFIX_TOKENS, "ttft_warm_suffix_s": suffix}


def decode_bytes_per_step(config: Any, context: int, kv_bytes_per_value: int = 4) -> float:
    """Bytes one batch-1 decode step must read: every fp32 weight once (the lm_head included,
    the embedding row not) plus the K and V of `context` cached tokens."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    norms = (2 * c.num_layers + 1) * c.hidden_size
    weights = 4 * (c.num_layers * per_layer + norms + c.vocab_size * c.hidden_size)
    return weights + 2 * c.num_layers * context * kv * kv_bytes_per_value


def bandwidth_figures(result: dict[str, Any], config: Any, bandwidth: dict[str, Any]) -> dict[str, Any]:
    """decode_fraction_of_bandwidth: the bytes a decode step reads per second ÷ copy bandwidth;
    warm_suffix_decode_steps: the warm suffix's TTFT in batch-1 decode steps."""
    context = result["decode_prompt_tokens"] + result["decode_new_tokens"] // 2
    step_bytes = decode_bytes_per_step(config, context)
    step_s = 1 / result["decode_tokens_per_s_ours"]
    return {"decode_bytes_per_step": step_bytes, "decode_step_s": step_s,
            "decode_fraction_of_bandwidth": step_bytes / step_s / bandwidth["copy_bytes_per_s"],
            "copy_bytes_per_s": bandwidth["copy_bytes_per_s"],
            "warm_suffix_decode_steps": result["ttft_warm_suffix_s"] / step_s}


def bench_concurrent(ours: Ours, theirs: Theirs, sizes: Sizes, rng: random.Random) -> dict[str, Any]:
    n = sizes.concurrent_requests
    prompts, wants = concurrent_mix(rng, sizes, ours.vocab)
    useful = sum(wants)
    seconds: dict[str, list[float]] = {"ours": [], **{f"theirs_bs{b}": [] for b in sizes.peer_batch_sizes}}
    outputs: dict[str, list[list[int]]] = {}
    # No warm-up rep here: each rep takes minutes and the earlier phases ran the same kernels.
    for rep in range(1, sizes.concurrent_reps + 1):
        progress(f"concurrent {n} requests ({useful:,} tokens to generate): "
                 f"rep {rep}/{sizes.concurrent_reps}")
        ours.reset()
        s, outputs["ours"] = timed(lambda: ours.generate(prompts, wants))
        seconds["ours"].append(s)
        progress(f"  ours: {s:.1f} s")
        for b in sizes.peer_batch_sizes:
            s, outputs[f"theirs_bs{b}"] = timed(lambda b=b: theirs.generate(prompts, wants, b))
            seconds[f"theirs_bs{b}"].append(s)
            progress(f"  transformers, batches of {b}: {s:.1f} s")
    assert [len(o) for o in outputs["ours"]] == wants
    tps = {side: useful / median(s) for side, s in seconds.items()}
    peer = max((k for k in tps if k != "ours"), key=tps.__getitem__)
    same = {k: sum(a == b for a, b in zip(outputs["ours"], v)) for k, v in outputs.items() if k != "ours"}
    return {f"concurrent_ratio_{n}": ratio(tps["ours"], tps[peer]),
            "concurrent_tokens_per_s_ours": tps["ours"],
            **{f"concurrent_tokens_per_s_{k}": v for k, v in tps.items() if k != "ours"},
            "concurrent_peer": peer, "concurrent_useful_tokens": useful,
            "concurrent_prompt_tokens": sum(map(len, prompts)),
            # Information only: padded batches change fp32 rounding, so a few may differ.
            "concurrent_requests_identical_to_peer": same}


def prefill_flops_per_token(config: Any, length: int) -> float:
    """Model FLOPs per prompt token of one length-token prefill, counting:

    * 2 x every non-embedding matmul weight (q, k, v, o, gate, up, down of each layer);
    * the lm_head (2 x vocab x hidden) once per prompt, for the last token only, spread over it;
    * attention QK^T and PV: 2 x 2 x head_dim per head per (query, key) pair, causal pairs
      only (length x (length + 1) / 2), spread over the prompt.
    Not counted: norms, RoPE, softmax, SiLU, residual adds and the embedding lookup.
    """
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    weights = 2 * c.num_layers * per_layer
    lm_head = 2 * c.vocab_size * c.hidden_size / length
    attention = c.num_layers * 4 * c.num_heads * c.head_dim * (length + 1) / 2
    return weights + lm_head + attention


# --- driver ---------------------------------------------------------------------------------
def concurrent_mix(rng: random.Random, sizes: Sizes,
                   vocab: int = SMOLLM2_VOCAB) -> tuple[list[list[int]], list[int]]:
    """The concurrent phase's requests: prompts of random lengths, then how many tokens each wants."""
    n = sizes.concurrent_requests
    prompts = [random_prompt(rng, rng.randint(*sizes.concurrent_prompt_range), vocab) for _ in range(n)]
    return prompts, [rng.randint(*sizes.concurrent_output_range) for _ in range(n)]


def random_prompt(rng: random.Random, length: int, vocab: int = SMOLLM2_VOCAB) -> list[int]:
    """Token ids from the ordinary vocabulary: above 100 (SmolLM2's specials are ids < 17, Gemma's
    control tokens < 100), below the tokenizer's size."""
    return [rng.randrange(100, vocab) for _ in range(length)]


def kv_blocks_needed(sizes: Sizes) -> int:
    bs = sizes.block_size
    longest = max(*sizes.prefill_lengths, sizes.warm_prompt_tokens) + 1
    per_request = sizes.concurrent_prompt_range[1] + sizes.concurrent_output_range[1]
    concurrent = sizes.concurrent_requests * ceil_div(per_request, bs)
    return max(concurrent, 2 * ceil_div(longest, bs)) + 16


def gguf_path(model: str | None) -> Path:
    """The GGUF both sides load: a named model's file (pdserve/engine/named_models.py) or a path."""
    from pdserve.engine.named_models import resolve_model_path
    path = Path(resolve_model_path(model))
    if not (path.is_file() and path.suffix == ".gguf"):
        raise FileNotFoundError(f"--model {model} gave {path}, which is not a GGUF file: the peer loads "
                                "the same GGUF (install the default model with `make setup`)")
    return path


def record(result: dict[str, Any], phase: dict[str, Any]) -> None:
    """Add a phase's figures, and log them: a run cut short still leaves them on stderr."""
    result.update(phase)
    progress("  " + json.dumps(phase))


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = QUICK if args.quick else FULL
    if args.reps is not None:
        sizes = Sizes(**{**asdict(sizes), "reps": args.reps, "concurrent_reps": args.reps})
    threads = set_threads(args.threads)
    load_at_start = warn_if_busy(threads)
    from pdserve.engine.weights import load_model

    path = gguf_path(args.model)
    progress(f"threads={threads}; loading {path.name} for pdserve")
    loaded = load_model(str(path), progress=False)
    ours = Ours(loaded, kv_blocks_needed(sizes), sizes.block_size, threads, **kernel_settings(args))
    progress("loading the same GGUF into transformers")
    theirs = Theirs(path)
    rng = random.Random(0)
    result: dict[str, Any] = {}

    progress("measuring fp32 matmul peak")
    peak = peak_matmul_flops(reps=max(3, sizes.reps + 2))
    bandwidth = copy_bandwidth(reps=max(3, sizes.reps + 2))
    decode_prompt = loaded.tokenizer.apply_chat_template(DECODE_MESSAGES)
    record(result, bench_decode(ours, theirs, decode_prompt, sizes))
    for length in sizes.prefill_lengths:
        record(result, bench_prefill(ours, theirs, length, sizes, rng))
    longest = max(sizes.prefill_lengths)
    flops = prefill_flops_per_token(loaded.config, longest)
    ours_tps = result[f"prefill_tokens_per_s_ours_{longest}"]
    result["prefill_fraction_of_peak"] = ours_tps * flops / peak["peak_flops"]
    result.update({"prefill_flops_per_token": flops, "prefill_fraction_length": longest,
                   "peak_matmul_flops": peak["peak_flops"], "matmul_flops_by_size": peak["flops_by_size"]})
    record(result, bench_warm_ttft(ours, sizes, rng))
    record(result, bandwidth_figures(result, loaded.config, bandwidth))
    record(result, bench_concurrent(ours, theirs, sizes, rng))
    assert not ours.engine.leaked_blocks()
    import transformers
    env = {**environment(threads), "loadavg_at_start": load_at_start}
    return {**result, "model": path.name, "architecture": loaded.config.architecture, "threads": threads,
            **kernel_settings(args),
            "kernels_chosen": ours.engine.kernels.describe(), "torch": torch.__version__,
            "transformers": transformers.__version__, "reps": sizes.reps,
            "concurrent_reps": sizes.concurrent_reps, "quick": args.quick, "sizes": asdict(sizes),
            "environment": env}


def _mark(ok: bool) -> str:
    return "yes" if ok else "NO"


def _prefill_rows(r: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for length in r["sizes"]["prefill_lengths"]:
        x = r[f"prefill_ratio_{length}"]
        rows.append([f"prefill {length:,} tok/s", r[f"prefill_tokens_per_s_ours_{length}"],
                     r[f"prefill_tokens_per_s_theirs_{length}"], x, ">= 1.0", _mark(x >= TARGETS["prefill"])])
        rows.append(["  vs logits_to_keep=1", r[f"prefill_tokens_per_s_ours_{length}"],
                     r[f"prefill_tokens_per_s_theirs_keep1_{length}"],
                     r[f"prefill_ratio_keep1_{length}"], "", ""])
    return rows


def _row(label: str, ours: Any, theirs: Any, value: float, target_key: str, at_least: bool) -> list[Any]:
    target = TARGETS[target_key]
    met = value >= target if at_least else value <= target
    return [label, ours, theirs, value, f"{'>=' if at_least else '<='} {target}", _mark(met)]


def _target_rows(r: dict[str, Any]) -> list[list[Any]]:
    n, peer = r["sizes"]["concurrent_requests"], r["concurrent_peer"]
    read_gb_s = r["decode_bytes_per_step"] / r["decode_step_s"] / 1e9
    return [
        _row("decode batch 1 tok/s", r["decode_tokens_per_s_ours"], r["decode_tokens_per_s_theirs"],
             r["decode_ratio_batch1"], "decode", True),
        _row("  GB/s read vs copy bandwidth", read_gb_s, r["copy_bytes_per_s"] / 1e9,
             r["decode_fraction_of_bandwidth"], "decode_bandwidth", True),
        _row(f"concurrent {n} tok/s ({peer})", r["concurrent_tokens_per_s_ours"],
             r[f"concurrent_tokens_per_s_{peer}"], r[f"concurrent_ratio_{n}"], "concurrent", True),
        _row("TTFT s, warm vs cold", r["ttft_warm_s"], r["ttft_cold_s"], r["warm_ttft_ratio"],
             "warm_ttft", False),
        _row(f"  {r['warm_suffix_tokens']}-token suffix, in decode steps", r["ttft_warm_suffix_s"],
             r["decode_step_s"], r["warm_suffix_decode_steps"], "warm_suffix_steps", False),
        _row(f"prefill {r['prefill_fraction_length']:,}: fraction of matmul peak", "", "",
             r["prefill_fraction_of_peak"], "prefill_peak", True),
    ]


def report(r: dict[str, Any]) -> str:
    rows = _prefill_rows(r) + _target_rows(r)
    table = format_table(["metric", "ours", "theirs", "ratio", "target", "met"], rows)
    peak = (f"prefill at {r['prefill_fraction_length']:,} tokens: {r['prefill_fraction_of_peak']:.1%} of "
            f"{r['peak_matmul_flops'] / 1e9:.1f} GFLOP/s fp32 matmul peak "
            f"({r['prefill_flops_per_token'] / 1e6:.1f} MFLOP/token)")
    head = (f"threads={r['threads']} linear_kernel={r['linear_kernel']} "
            f"attention_kernel={r.get('attention_kernel', 'sdpa')} "
            f"pointwise_kernel={r.get('pointwise_kernel', 'torch')} torch={r['torch']} "
            f"transformers={r['transformers']} reps={r['reps']} "
            f"(kernels run: {r.get('kernels_chosen', 'as set')}) "
            f"(concurrent {r['concurrent_reps']}); greedy tokens equal to transformers': "
            f"{r['decode_greedy_tokens_match']}")
    return "\n".join([head, table, peak])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bench_parser("python -m bench.engine", __doc__)
    p.add_argument("--quick", action="store_true",
                   help="smoke run (under ~2 minutes): shorter prompts (prefill 128/512, warm TTFT 512), "
                        "8 concurrent requests, 16 decode tokens, 1 rep; size-named keys follow the sizes "
                        "(e.g. prefill_ratio_128, concurrent_ratio_8)")
    add_threads_flag(p, "torch intra-op threads for both sides")
    p.add_argument("--model", default=None, metavar="NAME|GGUF",
                   help="the model both sides run: smollm2 (the default), gemma3-270m (`make gemma3`) or a "
                        ".gguf path that transformers can also read")
    add_kernel_flags(p)
    p.add_argument("--reps", type=int, default=None,
                   help="measured repetitions per phase after one warm-up; medians are reported "
                        f"(default {FULL.reps}, concurrent phase {FULL.concurrent_reps}; "
                        f"--quick {QUICK.reps})")
    return check_least(p, p.parse_args(argv), {"reps": 1})


def main(argv: list[str] | None = None) -> None:
    run_timed(run, report, parse_args(argv))


if __name__ == "__main__":
    main()
