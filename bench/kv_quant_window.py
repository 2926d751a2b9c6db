"""What int8 KV with the most recent tokens kept in float would give: an experiment, not an engine path.

    python -m bench.kv_quant_window [--json] [--prompts N] [--new-tokens N] [--windows block,16,64]
                                    [--threads N]

pdserve's int8 cache (pdserve/engine/kv_format.py, Hadamard-rotated rows) missed issue 18's greedy
agreement target (0.878 against >= 0.9 in bench.kv_quant) while every query attended every row as
int8 stores it. KIVI keeps a window of recent tokens in full precision. This measures, on SmolLM2
and bench.kv_quant's chat prompts, the greedy agreement int8 would reach if each query attended to:

  plain    every key and value as int8 stores them (int8 before 2026-12-06)
  1        its own token's key and value in float32, every earlier one as int8 stores it (today's
           int8: KVFormat.own_row_in_float32, the engine's no-cache reference)
  block    the keys and values of its own block (the block still being filled, 0-15 earlier
           tokens) in float32, every earlier block as int8 stores it: full blocks, the only ones
           the prefix cache shares and transfers, would stay pure int8
  W        the last W positions (itself included) in float32, older ones as int8

Teacher-forced along float32's greedy path (LLMEngine, as bench.kv_quant): one dense pass per prompt
computes every position's logits with the variant's K/V, and a prompt's agreement is the first
position whose argmax differs from float32's token, divided by --new-tokens (bench.kv_quant's
definition: before the first divergence both paths see the same context). Attention is computed
densely here (masks over [T, T]), so the figures say what a variant would reach, not what it costs.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from bench.common import environment, progress, set_threads
from bench.kv_quant import BLOCK_SIZE, PROMPTS, first_divergence, greedy_tokens

KV_DTYPE = "int8"


def fresh_mask(length: int, window: str) -> torch.Tensor:
    """[T, T] True where query t sees key s in float32 (the mask is only read where s <= t)."""
    pos = torch.arange(length)
    if window == "block":
        return (pos[:, None] // BLOCK_SIZE) == (pos[None, :] // BLOCK_SIZE)
    return (pos[:, None] - pos[None, :]) < int(window)


@torch.inference_mode()
def window_logits(model: Any, ids: list[int], window: str) -> torch.Tensor:
    """Logits of every position with keys and values in float32 where fresh_mask says, int8 elsewhere."""
    from pdserve.engine.kv_format import KV_FORMATS

    fmt, c, rms_norm = KV_FORMATS[KV_DTYPE], model.config, model.pointwise.rms_norm
    group = c.num_heads // c.num_kv_heads
    fresh = fresh_mask(len(ids), window)
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    rot = model.rope.at(torch.arange(len(ids)))
    h = model.embed[torch.tensor(ids)]
    for w in model.layers:
        q, k, v = model._qkv(rms_norm(h, w["ln1"], c.rms_norm_eps), rot, w)
        q = fmt.rotate(q)  # attention in the rows' basis, as the engine's

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(group, dim=1)

        k_int8, v_int8 = (heads(fmt.load_rotated(fmt.store(t))) for t in (k, v))
        k_float, v_float = heads(fmt.rotate(k)), heads(fmt.rotate(v))
        scores = torch.where(fresh, torch.einsum("thd,shd->hts", q, k_float),
                             torch.einsum("thd,shd->hts", q, k_int8)) * model.scale
        p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        out = (torch.einsum("hts,shd->thd", p * fresh, v_float)
               + torch.einsum("hts,shd->thd", p * ~fresh, v_int8))
        h = h + model.linear(fmt.unrotate(out).reshape(-1, model.q_size), w["o"])
        h = h + model._mlp(rms_norm(h, w["ln2"], c.rms_norm_eps), w)
    return model.linear(rms_norm(h, model.final_norm, c.rms_norm_eps), model.lm_head)


def agreement(model: Any, prompts: list[list[int]], reference: list[list[int]],
              window: str) -> dict[str, float]:
    scores = []
    for prompt, tokens in zip(prompts, reference):
        ids = prompt + tokens[:-1]
        logits = window_logits(model, ids, "0" if window == "plain" else window)
        predicted = logits[len(prompt) - 1:].argmax(-1).tolist()
        scores.append(first_divergence(predicted, tokens) / len(tokens))
    return {"greedy_agreement": sum(scores) / len(scores),
            "all_agree_share": sum(s == 1.0 for s in scores) / len(scores)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.engine.model import LlamaModel
    from pdserve.engine.weights import load_model

    threads = set_threads(args.threads)
    loaded = load_model(None, progress=False)
    model = LlamaModel(loaded.config, loaded.state_dict, torch.device("cpu"))
    prompts = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in PROMPTS[:args.prompts]]
    progress(f"float32: {len(prompts)} prompts x {args.new_tokens} greedy tokens")
    reference = greedy_tokens(loaded, "float32", prompts, args.new_tokens)
    result: dict[str, Any] = {}
    for window in ["plain", *args.windows]:
        progress(f"int8, float window {window}")
        result[window] = agreement(model, prompts, reference, window)
    return {"windows": result, "prompts": len(prompts), "new_tokens": args.new_tokens,
            "environment": environment(threads)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kv_quant_window", description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32,
                   help=f"chat prompts, 1-{len(PROMPTS)} (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens a prompt (default: %(default)s)")
    p.add_argument("--windows", type=lambda s: [w for w in s.split(",") if w], default=["block", "16", "64"],
                   help="comma-separated: block, or a count of recent positions (default: block,16,64)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS) or args.new_tokens < 1:
        p.error(f"--prompts must be in [1, {len(PROMPTS)}] and --new-tokens >= 1")
    bad = [w for w in args.windows if w != "block" and not (w.isdigit() and int(w) >= 1)]
    if bad:
        p.error(f"--windows takes block or positive counts, got {', '.join(bad)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return
    for window, r in result["windows"].items():
        print(f"{window:>6}  greedy agreement {r['greedy_agreement']:.3f}  "
              f"all agree {r['all_agree_share']:.3f}")


if __name__ == "__main__":
    main()
