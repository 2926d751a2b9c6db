"""bench.gpu_check's stages on one process: card, triton_kernels, exactness, decode, prefill,
llama_1b (kv_push, which needs processes of its own, is bench/gpu_check_push.py).

Each stage takes the run's Context (bench/gpu_check.py: sizes, device, scratch folder, the card's
figures) and returns its results as a dict; raising fails the stage alone. Stage by stage:

  card            copy bandwidth: a device-to-device copy of copy_mib, timed with CUDA events, median
                  of reps, counted as bytes read + written (STREAM's convention, as bench.common's
                  copy_bandwidth); matmul: square n x n products, 2 n^3 FLOP each, bf16 and fp32 with
                  TF32 off
  triton_kernels  for each KV format and shape: random K/V rows stored as the format stores them
                  (KV_FORMATS[name].store), blocks shuffled over the pool, the Triton kernel and the
                  torch reference called with the same arguments; max abs error <= the tolerance
  exactness       greedy tokens of LLMEngine (float32, TF32 off) against transformers' own greedy
                  loop (its KV cache, argmax of its logits) on the same folder; a prompt passes when
                  its tokens are equal, or when they part only where transformers' top two logits
                  are closer than TIE_MARGIN (reported as a tie, never silently)
  decode          B requests of a prompt of decode_prompt_tokens, greedy, ignore_eos; every engine
                  step timed (its sampled tokens come back to the host, so a step ends when its work
                  does); tokens/s = B / median decode-only step
  prefill         one prompt of T tokens, max_tokens 1, the whole prompt in one step, prefix cache off
"""

from __future__ import annotations

import os
import platform
import random
import traceback
from dataclasses import asdict
from typing import Any

import torch

from bench.common import median, progress
from bench.gpu_check_model import (
    ModelShape,
    Skip,
    build_engine,
    device_timed,
    engine_facts,
    free_device_memory,
    parameter_counts,
    sync,
    weight_element_bytes,
    write_random_model,
)

ERROR_TAIL_CHARS = 3000
TIE_MARGIN = 1e-4  # tests/conftest.py MIN_GREEDY_MARGIN: a hundred times what batching moves a logit by
# NOTE: the kernel and the reference read the same stored rows, so only the order of the sums and
# the kernel's own roundings differ: float32 rows allow for a TF32 dot where Triton takes one,
# the others for probabilities rounded to the rows' 16-bit type before the P.V product.
KERNEL_REPS = 20
KERNEL_TOLERANCE = {"float32": 5e-3, "float16": 2e-2, "bfloat16": 3e-2, "int8": 2e-2, "fp8": 2e-2}


# --- card --------------------------------------------------------------------------------------
def card(ctx) -> dict[str, Any]:
    s, device = ctx.sizes, torch.device(ctx.device)
    facts = device_facts(device)
    copy = copy_bandwidth(device, s.copy_mib, s.copy_reps)
    bf16 = matmul_rate(device, s.matmul_n, torch.bfloat16, s.matmul_reps)
    fp32 = matmul_rate(device, s.matmul_fp32_n, torch.float32, s.matmul_reps)
    ctx.card = {"copy_gbps": copy["copy_gbps"], "bf16_tflops": bf16["tflops"], "fp32_tflops": fp32["tflops"]}
    return {**facts, **copy, "matmul_bf16": bf16, "matmul_fp32_no_tf32": fp32}


def device_facts(device: torch.device) -> dict[str, Any]:
    facts: dict[str, Any] = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda,
                             "python": platform.python_version(), "triton": _triton_version()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts |= {"device_name": props.name, "memory_gib": props.total_memory / 2**30,
                  "capability": f"{props.major}.{props.minor}",
                  "multiprocessors": props.multi_processor_count,
                  "driver_free_gib": torch.cuda.mem_get_info(device)[0] / 2**30}
    else:
        facts |= {"device_name": platform.processor() or platform.machine(),
                  "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
                  "note": "CPU: the same code as on a GPU, at tiny sizes; the figures mean nothing"}
    return facts


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError as error:
        return f"not importable: {error}"
    return triton.__version__


def event_seconds(fn, device: torch.device, reps: int) -> list[float]:
    """Seconds of each of reps calls of fn after one warm-up: CUDA events on a GPU, the host clock
    around a synchronised call elsewhere."""
    fn()
    sync(device)
    if device.type != "cuda":
        return [device_timed(fn, device)[0] for _ in range(reps)]
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def copy_bandwidth(device: torch.device, mib: int, reps: int) -> dict[str, Any]:
    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    seconds = median(event_seconds(lambda: dst.copy_(src), device, reps))
    nbytes = src.numel() * 4
    return {"copy_gbps": 2 * nbytes / seconds / 1e9, "copy_mib": mib, "copy_reps": reps,
            "copy_counts": "bytes read + bytes written"}


def matmul_rate(device: torch.device, n: int, dtype: torch.dtype, reps: int) -> dict[str, Any]:
    allow = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        seconds = median(event_seconds(lambda: torch.mm(a, b), device, reps))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "tflops": 2 * n**3 / seconds / 1e12,
            "reps": reps}


def card_figures(ctx) -> dict[str, float]:
    """The card stage's figures, measured now (small) when that stage did not run in this call."""
    if not ctx.card:
        progress("gpu_check: the card stage did not run; measuring bandwidth and matmul peak first")
        card(ctx)
    return ctx.card


# --- triton_kernels ----------------------------------------------------------------------------
def triton_kernels(ctx) -> dict[str, Any]:
    from pdserve.engine import attention_reference as reference
    from pdserve.engine import triton_attention as kernels
    from pdserve.engine.kv_format import KV_FORMATS

    device, block_size = torch.device(ctx.device), ctx.sizes.block_size
    cases, worst = [], {}
    for fmt_name, fmt in KV_FORMATS.items():
        tolerance = KERNEL_TOLERANCE[fmt_name]
        for kind, shapes in (("decode", ctx.sizes.decode_shapes), ("prefill", ctx.sizes.prefill_shapes)):
            for shape in shapes:
                record = {"format": fmt_name, "kind": kind, **asdict(shape), "tolerance": tolerance}
                seed = len(cases)
                done, error = attempt(lambda f=fmt, k=kind, sh=shape, n=seed: kernel_case(
                    kernels, reference, f, k, sh, block_size, device, n))
                record |= done if error is None else {"error": error, "ok": False}
                cases.append(record)
                if error is None:
                    record["ok"] = record["max_abs_error"] <= tolerance
                    worst[fmt_name] = max(worst.get(fmt_name, 0.0), record["max_abs_error"])
    failed = [c for c in cases if not c["ok"]]
    result = {"cases": cases, "max_abs_error_by_format": worst, "failed_cases": len(failed),
              "interpreted": os.environ.get("TRITON_INTERPRET") == "1"}
    if failed:
        result["status"] = "failed"
        result["error"] = f"{len(failed)} case(s) above tolerance: {failed[:3]}"
    return result


def kernel_case(kernels, reference, fmt, kind: str, shape, block_size: int, device: torch.device,
                seed: int) -> dict[str, Any]:
    """The kernel's max abs error against the reference on one case, and the kernel's time (CUDA
    events, median of KERNEL_REPS after a warm-up; on the CPU one interpreted call, meaningless)."""
    case = attention_case(fmt, kind, shape, block_size, device, seed)
    kernel = getattr(kernels, f"paged_{kind}_attention")
    ours = kernel(*case["args"], **case["kwargs"])
    ref = getattr(reference, f"paged_{kind}_attention")(*case["args"], **case["kwargs"])
    reps = KERNEL_REPS if device.type == "cuda" else 1
    seconds = median(event_seconds(lambda: kernel(*case["args"], **case["kwargs"]), device, reps))
    return {"max_abs_error": float((ours.float() - ref.float()).abs().max()), "kernel_us": seconds * 1e6}


def attention_case(fmt, kind: str, shape, block_size: int, device: torch.device, seed: int) -> dict[str, Any]:
    """Arguments of one paged attention call. Decode: one query per sequence, each row's context
    (its own token included) already in the pool. Prefill: one sequence's chunk of shape.rows queries
    from position shape.context, every row up to the chunk's end in the pool. Blocks are shuffled
    over a pool larger than needed, so a kernel that reads blocks in order fails."""
    gen = torch.Generator().manual_seed(seed)
    d, kvh = shape.head_dim, shape.num_kv_heads
    sequences = shape.rows if kind == "decode" else 1
    tokens = shape.context if kind == "decode" else shape.context + shape.rows
    per_seq = -(-tokens // block_size)
    num_blocks = sequences * per_seq + 3
    order = torch.randperm(num_blocks, generator=gen)[:sequences * per_seq].view(sequences, per_seq)
    k = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    v = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    cache = torch.stack([fmt.store(k), fmt.store(v)]).to(device)
    rows = sequences if kind == "decode" else shape.rows
    q = torch.randn(rows, shape.num_heads, d, generator=gen).to(device)
    scale = d ** -0.5
    kwargs: dict[str, Any] = {}
    if fmt.own_row_in_float32:  # the query's own K/V as the model computed it (kv_format's docstring)
        own_rows = sequences if kind == "decode" else shape.rows
        kwargs["own_k"] = torch.randn(own_rows, kvh, d, generator=gen).to(device)
        kwargs["own_v"] = torch.randn(own_rows, kvh, d, generator=gen).to(device)
    if kind == "decode":  # each row its own length, the first the longest: the table's width
        lens = torch.tensor([shape.context - (b * 37) % max(1, shape.context // 2) for b in range(sequences)],
                            dtype=torch.int32, device=device)
        args = (q, cache, order.to(device=device, dtype=torch.int32), lens, scale, shape.window)
    else:
        args = (q, cache, order[0].to(device=device, dtype=torch.int32), shape.context, scale, shape.window)
    return {"args": args, "kwargs": kwargs}


# --- exactness ---------------------------------------------------------------------------------
def model_folder(ctx, key: str, shape: ModelShape):
    """The random model of `shape`, written once per run into the scratch folder."""
    if key not in ctx.models:
        progress(f"gpu_check: writing a random {key} model ({shape.num_layers} layers, "
                 f"hidden {shape.hidden_size})")
        ctx.models[key] = write_random_model(ctx.scratch / key, shape)
    return ctx.models[key]


def load(ctx, key: str, shape: ModelShape):
    from pdserve.engine.weights import load_model

    return load_model(str(model_folder(ctx, key, shape)), progress=False)


def prompts(count_lengths: tuple[int, ...], vocab: int, seed: int) -> list[list[int]]:
    """Random ids past the special tokens, a first token of its own per prompt (no shared prefix)."""
    rng = random.Random(seed)
    return [[3 + (seed * 101 + i) % (vocab - 3)] + [rng.randrange(3, vocab) for _ in range(n - 1)]
            for i, n in enumerate(count_lengths)]


def exactness(ctx) -> dict[str, Any]:
    from pdserve.engine.sequence import SamplingParams

    s, device = ctx.sizes, ctx.device
    set_tf32(False)
    loaded = load(ctx, "smollm2_135m", s.smol)
    batch = prompts(s.exact_prompt_tokens, s.smol.vocab_size, seed=1)
    blocks = len(batch) * (-(-(max(s.exact_prompt_tokens) + s.exact_new_tokens) // s.block_size)) + 8
    greedy = SamplingParams(temperature=0.0, max_tokens=s.exact_new_tokens, ignore_eos=True)
    ours: dict[str, tuple[list[list[int]], dict[str, Any], list[str]]] = {}
    result: dict[str, Any] = {"tie_margin": TIE_MARGIN, "tf32": False, "engines": {}}
    failures = []
    for name, settings in exactness_engines(device):
        def run(settings=settings):
            engine, missing = build_engine(loaded, device, num_blocks=blocks, block_size=s.block_size,
                                           dtype="float32", kv_dtype="float32", **settings)
            tokens = [r.token_ids for r in engine.generate(batch, greedy, detokenize=False)]
            return tokens, engine_facts(engine), missing

        done, error = attempt(run)
        free_device_memory(device)
        if error:
            result["engines"][name] = {"error": error}
            failures.append(f"exactness {name}: {last_line(error)}")
        else:
            ours[name] = done
    hf = hf_model(model_folder(ctx, "smollm2_135m", s.smol), device)
    theirs = [hf_greedy(hf, prompt, s.exact_new_tokens, device) for prompt in batch]
    del hf
    free_device_memory(device)
    bad = []
    for name, (tokens, facts, missing) in ours.items():
        per_prompt = [compare(prompt, mine, *hf_side) for prompt, mine, hf_side in zip(batch, tokens, theirs,
                                                                                       strict=True)]
        bad += [(name, p) for p in per_prompt if p["verdict"] == "differ"]
        result["engines"][name] = {
            "engine": facts, "settings_missing": missing, "prompts": per_prompt,
            "identical": sum(p["verdict"] == "identical" for p in per_prompt),
            "parted_at_ties": sum(p["verdict"] == "tie" for p in per_prompt)}
    if bad:
        failures.append(f"{len(bad)} (engine, prompt) pair(s) differ from transformers at a clear margin; "
                        f"first: {bad[0]}")
    return result | failed_parts(failures)


def exactness_engines(device: str) -> list[tuple[str, dict[str, Any]]]:
    """The engines held to transformers' tokens: the defaults (on CUDA: the Triton attention, the
    static step as CUDA graphs), and sdpa attention beside them, so a difference names its kernel.
    On the CPU: torch's kernels, and the interpreted Triton attention with the static step."""
    if torch.device(device).type == "cpu":
        return [("torch_kernels", {}),
                ("triton_static", {"attention_kernel": "triton", "decode_step": "static"})]
    return [("defaults", {}), ("sdpa", {"attention_kernel": "sdpa"})]


def set_tf32(allowed: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = allowed
    torch.backends.cudnn.allow_tf32 = allowed
    torch.set_float32_matmul_precision("high" if allowed else "highest")


def hf_model(folder, device: str):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    except TypeError:  # transformers before 4.56 names it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32)
    return model.to(device).eval()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int, device: str) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation through its own KV cache, and the gap between its top two
    logits at each step."""
    out = model(torch.tensor([prompt], device=device), use_cache=True)
    tokens, margins = [], []
    for _ in range(n):
        logits = out.logits[0, -1].float()
        top = torch.topk(logits, 2)
        tokens.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        out = model(torch.tensor([[tokens[-1]]], device=device), past_key_values=out.past_key_values,
                    use_cache=True)
    return tokens, margins


def compare(prompt: list[int], ours: list[int], theirs: list[int], margins: list[float]) -> dict[str, Any]:
    record: dict[str, Any] = {"prompt_tokens": len(prompt), "new_tokens": len(theirs),
                              "smallest_margin": min(margins)}
    if ours == theirs:
        return record | {"verdict": "identical"}
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    margin = margins[first] if first < len(margins) else float("nan")
    return record | {"verdict": "tie" if margin < TIE_MARGIN else "differ", "first_divergence": first,
                     "margin_there": margin, "ours": ours[first:first + 4], "theirs": theirs[first:first + 4]}


# --- decode and prefill ------------------------------------------------------------------------
def variants(device: str) -> list[tuple[str, dict[str, Any], str | None]]:
    """(name, engine settings, note): the dynamic step (each step's tensors at its own size), the
    static step op by op, and the static step as CUDA graphs (one per batch bucket, captured as the
    engine is built). On the CPU nothing is captured: "graph" runs the static step eagerly, on the
    interpreted Triton attention (the static step needs a paged kernel), and eager_static, which
    would run the same again, is left out."""
    if torch.device(device).type == "cpu":
        static = {"decode_step": "static", "enforce_eager": True, "attention_kernel": "triton"}
        return [("eager_dynamic", {"decode_step": "dynamic", "enforce_eager": True}, None),
                ("graph", static, "not captured on cpu: the static step ran eagerly")]
    return [("eager_dynamic", {"decode_step": "dynamic", "enforce_eager": True}, None),
            ("eager_static", {"decode_step": "static", "enforce_eager": True}, None),
            ("graph", {"decode_step": "static", "enforce_eager": False}, None)]


def model_settings(device: str) -> dict[str, Any]:
    """The dtype of weights and KV on each device: bf16 on a GPU (what one serves with), float32 on
    the CPU (the dry run's reference path)."""
    if torch.device(device).type == "cpu":
        return {"dtype": "float32", "kv_dtype": "float32"}
    return {"dtype": "bfloat16", "kv_dtype": "bfloat16"}


def decode_rates(ctx, loaded, batches: tuple[int, ...], prompt_tokens: int,
                 new_tokens: int) -> dict[str, Any]:
    """Each variant's rows; a variant that raises is recorded under decode_engines and the others
    still run (graph capture failing must not hide the eager figures)."""
    settings = model_settings(ctx.device)
    bandwidth = card_figures(ctx)["copy_gbps"] * 1e9
    rows, engines, failures = [], {}, []
    for name, step_settings, note in variants(ctx.device):
        done, error = attempt(lambda n=name, k=step_settings, t=note: decode_variant(
            ctx, loaded, n, k, t, batches, prompt_tokens, new_tokens, bandwidth))
        free_device_memory(ctx.device)
        if error:
            engines[name] = {"error": error}
            failures.append(f"decode {name}: {last_line(error)}")
            continue
        engines[name], variant_rows = done
        rows += variant_rows
    result = {"decode": rows, "decode_engines": engines, "bandwidth_gbps": bandwidth / 1e9,
              "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, **settings}
    return result | failed_parts(failures)


def decode_variant(ctx, loaded, name: str, step_settings: dict[str, Any], note: str | None,
                   batches: tuple[int, ...], prompt_tokens: int, new_tokens: int,
                   bandwidth: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from pdserve.engine.sequence import SamplingParams

    device, block_size, settings = ctx.device, ctx.sizes.block_size, model_settings(ctx.device)
    per_seq = -(-(prompt_tokens + new_tokens) // block_size)
    build_s, (engine, missing) = device_timed(lambda: build_engine(
        loaded, device, num_blocks=max(batches) * per_seq + 16, block_size=block_size,
        kv_dtype=settings["kv_dtype"], max_seqs=max(batches), max_batched_tokens=max(2048, prompt_tokens),
        dtype=settings["dtype"], **step_settings), device)
    if {"enforce_eager", "decode_step"} & set(missing) and name != "eager_dynamic":
        return {"skipped": "EngineConfig has no " + ", ".join(missing)}, []
    counts = parameter_counts(loaded)
    weight_bytes = (counts["layer_matmul"] + counts["lm_head"]) * weight_element_bytes(engine)
    rows = []
    for batch in batches:
        progress(f"gpu_check: decode {name}, batch {batch}")
        vocab = loaded.config.vocab_size
        run_batch(engine, prompts((prompt_tokens,) * batch, vocab, seed=7),
                  SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))  # warm-up
        steps = run_batch(engine, prompts((prompt_tokens,) * batch, vocab, seed=8),
                          SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
        full = [(t, shape) for t, shape in steps
                if shape is not None and not shape.prefill and shape.decode_seqs == batch]
        if not full:
            raise RuntimeError(f"batch {batch}: no step decoded all {batch} sequences together")
        kv_bytes = median([shape.decode_context for _, shape in full]) * loaded.config.kv_bytes_per_token(
            settings["kv_dtype"])
        step_s = median([t for t, _ in full])
        bound = batch * bandwidth / (weight_bytes + kv_bytes)
        rows.append({"variant": name, "batch": batch, "tokens_per_s": batch / step_s, "step_ms": step_s * 1e3,
                     "bound_tokens_per_s": bound, "fraction_of_bandwidth_bound": batch / step_s / bound,
                     "weight_bytes": weight_bytes, "kv_bytes_read": kv_bytes, "steps": len(full),
                     **({"note": note} if note else {})})
    return engine_facts(engine) | {"build_s": build_s, "settings_missing": missing}, rows


def attempt(fn) -> tuple[Any, str | None]:
    """(fn(), None), or (None, the traceback's tail) where fn raises: one part of a stage failing
    leaves the stage's other parts their results."""
    try:
        return fn(), None
    except Exception:  # noqa: BLE001 -- recorded in the stage's JSON, the stage goes on
        return None, traceback.format_exc()[-ERROR_TAIL_CHARS:]


def last_line(error: str) -> str:
    return (error.strip().splitlines() or [""])[-1]


def failed_parts(failures: list[str]) -> dict[str, Any]:
    """What a stage whose parts failed adds to its result: status failed and each part's error."""
    return {"status": "failed", "error": "; ".join(failures)} if failures else {}


def run_batch(engine, batch: list[list[int]], sampling) -> list[tuple[float, Any]]:
    """Every step of running batch to the end: (seconds, the step's StepShape)."""
    for prompt in batch:
        engine.add_request(prompt, sampling, detokenize=False)
    steps = []
    while engine.has_unfinished():
        seconds, _ = device_timed(engine.step, engine.device)
        steps.append((seconds, engine.last_step))
    return steps


def prefill_rates(ctx, loaded, lengths: tuple[int, ...], reps: int) -> dict[str, Any]:
    device, block_size, c = ctx.device, ctx.sizes.block_size, loaded.config
    figures = card_figures(ctx)
    counts = parameter_counts(loaded)
    settings = model_settings(device)
    engine, missing = build_engine(loaded, device, num_blocks=2 * -(-max(lengths) // block_size) + 8,
                                   block_size=block_size, kv_dtype=settings["kv_dtype"],
                                   max_batched_tokens=max(lengths), dtype=settings["dtype"])
    element = weight_element_bytes(engine)
    peak = (figures["bf16_tflops"] if element == 2 else figures["fp32_tflops"]) * 1e12
    rows = []
    for n in lengths:
        progress(f"gpu_check: prefill {n} tokens")
        prefill_once(engine, prompts((n,), c.vocab_size, seed=11)[0])  # warm-up
        times = [prefill_once(engine, prompts((n,), c.vocab_size, seed=12 + k)[0]) for k in range(reps)]
        attention = 2 * c.num_layers * c.num_heads * c.head_dim * n * (n + 1)
        flops = 2 * counts["layer_matmul"] * n + 2 * counts["lm_head"] + attention
        seconds = median(times)
        rows.append({"tokens": n, "seconds": seconds, "tflops": flops / seconds / 1e12,
                     "fraction_of_matmul_peak": flops / seconds / peak, "flops": flops,
                     "attention_flops": attention, "reps": reps})
    facts = engine_facts(engine)
    del engine
    free_device_memory(device)
    return {"prefill": rows, "peak_tflops": peak / 1e12,
            "peak_dtype": "bfloat16" if element == 2 else "float32",
            "flops_count": "2 x layer matmul params x tokens + 2 x lm_head params (last row) + causal "
                           "attention 2 x layers x heads x head_dim x T(T+1)",
            "engine": facts, "settings_missing": missing, **settings}


def prefill_once(engine, prompt: list[int]) -> float:
    """Seconds from submitting prompt to its first token (one step: the budget holds the prompt)."""
    from pdserve.engine.sequence import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    return device_timed(lambda: engine.generate([prompt], one, detokenize=False), engine.device)[0]


def decode(ctx) -> dict[str, Any]:
    s = ctx.sizes
    loaded = load(ctx, "smollm2_135m", s.smol)
    return decode_rates(ctx, loaded, s.decode_batches, s.decode_prompt_tokens, s.decode_new_tokens)


def prefill(ctx) -> dict[str, Any]:
    s = ctx.sizes
    return prefill_rates(ctx, load(ctx, "smollm2_135m", s.smol), s.prefill_tokens, s.prefill_reps)


def llama_1b(ctx) -> dict[str, Any]:
    s = ctx.sizes
    loaded = load(ctx, "llama_3_2_1b", s.llama)
    result: dict[str, Any] = {"params": parameter_counts(loaded)}
    decoded = decode_rates(ctx, loaded, s.llama_decode_batches, s.decode_prompt_tokens, s.llama_new_tokens)
    failures = [decoded.pop("error")] if decoded.pop("status", "ok") == "failed" else []
    prefilled, error = attempt(lambda: prefill_rates(ctx, loaded, s.llama_prefill_tokens,
                                                     1 if ctx.dry_run else 2))
    free_device_memory(ctx.device)
    if error:
        failures.append(f"prefill: {last_line(error)}")
        prefilled = {"prefill_error": error}
    return result | decoded | prefilled | failed_parts(failures)


__all__ = ["Skip", "card", "decode", "exactness", "llama_1b", "prefill", "triton_kernels"]
