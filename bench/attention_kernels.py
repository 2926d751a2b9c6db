"""The engine's attention kernels on SmolLM2's shapes: torch's SDPA over gathered blocks, and
pdserve's paged kernels, for decode rows and for prefill chunks.

    python -m bench.attention_kernels [--json] [--threads N] [--reps N] [--only decode|prefill|paths]

Decode: for B decode rows (1, 8, 32) with context lengths drawn as bench.engine's concurrent mix
draws prompts (32-512 tokens), and one row of 2,048. Prefill: one chunk of N new tokens after C
cached ones: 14 after 544 and after 1,920 (bench.engine's suffix), 128 after 1,920 (its warm TTFT),
and fresh prompts of 512 and 2,048. A pool of 16-token blocks holds every row's K/V,
the blocks shuffled over the pool as a long-running engine leaves them. Each kernel attends the
same queries over 30 distinct pool layers in turn, so that each call reads its rows from memory as
a model's layers do:
  sdpa  DecoderModel's own path (attention_kernel sdpa). Decode: rows grouped by length, each group's
        blocks gathered into a dense copy, torch's SDPA with a mask. Prefill: the context's blocks
        gathered and a masked SDPA, or a causal SDPA over the chunk's own K/V when nothing is cached
        (pdserve/engine/model.py)
  native  pdserve::paged_decode_attention over the block tables (pdserve/engine/decode_attention.cpp),
        pdserve::paged_prefill_attention over the chunk's (pdserve/engine/prefill_attention.cpp)
The two alternate rep by rep. Reported: medians of --reps passes, per layer; ratio = sdpa ÷ native
(how many times faster the paged kernel is); the K/V bytes the rows hold ÷ native's time (decode) or
the attention's FLOPs ÷ native's time (prefill); and the largest difference between the two outputs.

Paths: the paged prefill attention's two paths on chunks of 1 to 128 queries after 1,920 cached
rows, 256 after 1,792, 14 after 544 and 128 fresh, alternating the same way: tiled (every key
transposed once per call, 12 query rows a tile) and lanes (query rows in a vector's lanes, each key
read in place), forced by
pdserve::paged_prefill_attention_on. The kernel takes the lanes path up to
prefill_attention_lane_rows() query rows a KV head; where the two columns cross is what sets it.
Ratio = tiled ÷ lanes; the outputs must be equal bit for bit (max |diff| 0).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch

from bench.common import (
    add_threads_flag,
    bench_parser,
    check_least,
    environment,
    format_table,
    publish,
    set_threads,
    warn_if_busy,
)
from pdserve.engine import cpu_kernels
from pdserve.engine.kv_format import KV_FORMATS
from pdserve.engine.model import AttentionMetadata, DecoderModel, PrefillSegment
from pdserve.units import ceil_div

LAYERS = 30
BLOCK_SIZE = 16
CASES = {"1 x 32-512": (1, None), "8 x 32-512": (8, None), "32 x 32-512": (32, None), "1 x 2,048": (1, 2048)}
PREFILL_CASES = {"14 after 544": (544, 14), "14 after 1,920": (1920, 14), "128 after 1,920": (1920, 128),
                 "512 fresh": (0, 512), "2,048 fresh": (0, 2048)}  # (cached, new) tokens
PATH_CASES = {"1 after 1,920": (1920, 1), "14 after 1,920": (1920, 14), "32 after 1,920": (1920, 32),
              "64 after 1,920": (1920, 64), "128 after 1,920": (1920, 128), "256 after 1,792": (1792, 256),
              "14 after 544": (544, 14), "128 fresh": (0, 128)}


class Case:
    """Queries, 30 pool layers and block tables for B rows; the engine's metadata for them."""

    def __init__(self, model: DecoderModel, rows: int, length: int | None, rng: random.Random) -> None:
        c = model.config
        self.lens = torch.tensor([length or rng.randint(32, 512) for _ in range(rows)])
        widths = [ceil_div(int(n), BLOCK_SIZE) for n in self.lens]
        blocks = sum(widths) + 1
        order = torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(rows)) + 1
        self.tables = torch.zeros(rows, max(widths), dtype=torch.long)  # padding: block 0
        taken = 0
        for b, w in enumerate(widths):
            self.tables[b, :w] = order[taken:taken + w]
            taken += w
        self.layers = [torch.randn(2, blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim) for _ in range(LAYERS)]
        self.q = torch.randn(rows, c.num_heads, c.head_dim)
        zeros = torch.zeros(rows, dtype=torch.long)
        self.meta = AttentionMetadata(zeros, zeros, rows, self.tables, self.lens, ())
        self.kv_bytes = int(self.lens.sum()) * c.num_kv_heads * c.head_dim * 4 * 2


class PrefillCase:
    """A chunk of `new` queries after `cached` rows of one sequence: 30 pool layers holding all its
    rows (the chunk's own written, as the engine writes them before attending), its block table, and
    the chunk's own K/V for SDPA's fresh path."""

    def __init__(self, model: DecoderModel, cached: int, new: int) -> None:
        c = model.config
        width = ceil_div(cached + new, BLOCK_SIZE)
        self.table = torch.randperm(width + 8, generator=torch.Generator().manual_seed(cached + new))[:width]
        shape = (2, width + 8, BLOCK_SIZE, c.num_kv_heads, c.head_dim)
        self.layers = [torch.randn(shape) for _ in range(LAYERS)]
        self.q = torch.randn(new, c.num_heads, c.head_dim)
        self.segment = PrefillSegment(0, new, cached, self.table)
        slots = torch.arange(cached, cached + new)
        self.own = [layer[:, self.table[slots // BLOCK_SIZE], slots % BLOCK_SIZE] for layer in self.layers]
        self.lens = [cached + new]
        # QK and PV: 2 x 2 x head_dim FLOPs per (query head, visible key)
        visible = new * cached + new * (new + 1) // 2
        self.flops = 4 * c.head_dim * c.num_heads * visible


def sdpa_attention(model: DecoderModel, case: Case):
    fmt = KV_FORMATS["float32"]
    groups = DecoderModel._decode_groups(case.meta, BLOCK_SIZE)  # once per step in the engine too
    return lambda layer: model._decode_attention(case.q, case.layers[layer], fmt, case.meta, groups)


def paged_attention(model: DecoderModel, case: Case):
    attend = cpu_kernels.paged_decode_attention()
    return lambda layer: attend(case.q, case.layers[layer], case.tables, case.lens, model.scale)


def sdpa_prefill(model: DecoderModel, case: PrefillCase):
    fmt = KV_FORMATS["float32"]
    return lambda layer: model._prefill_attention(case.q, case.own[layer][0], case.own[layer][1],
                                                  case.segment, case.layers[layer], fmt)


def paged_prefill(model: DecoderModel, case: PrefillCase):
    attend = cpu_kernels.paged_prefill_attention()
    return lambda layer: attend(case.q, case.layers[layer], case.table, case.segment.start, model.scale)


def prefill_on(path: str):
    def side(model: DecoderModel, case: PrefillCase):
        attend = cpu_kernels.paged_prefill_attention_on(path)
        return lambda layer: attend(case.q, case.layers[layer], case.table, case.segment.start, model.scale)
    return side


# per kind: the two sides, the first the baseline (ratio = first ÷ second)
SIDES = {"decode": {"sdpa": sdpa_attention, "native": paged_attention},
         "prefill": {"sdpa": sdpa_prefill, "native": paged_prefill},
         "paths": {"tiled": prefill_on("tiled"), "lanes": prefill_on("lanes")}}


def seconds_per_layer(fn: Any) -> float:
    start = time.perf_counter()
    for layer in range(LAYERS):
        fn(layer)
    return (time.perf_counter() - start) / LAYERS


def measure(model: DecoderModel, kind: str, name: str, case: Case | PrefillCase, reps: int) -> dict[str, Any]:
    sides = {side: make(model, case) for side, make in SIDES[kind].items()}
    base, ours = sides
    with torch.inference_mode():
        diff = (sides[base](0) - sides[ours](0)).abs().max().item()  # also the warm-up
        times: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(reps):
            for side, fn in sides.items():
                times[side].append(seconds_per_layer(fn))
    first, second = (statistics.median(times[k]) for k in sides)
    rate = ({"avx2_kv_gb_per_s": case.kv_bytes / second / 1e9} if kind == "decode"
            else {f"{ours}_gflop_per_s": case.flops / second / 1e9,
                  f"{base}_gflop_per_s": case.flops / first / 1e9})
    return {"kind": kind, "case": name, "rows": len(case.q), "context_tokens": int(sum(case.lens)),
            f"{base}_ms_per_layer": first * 1e3, f"{ours}_ms_per_layer": second * 1e3,
            "ratio": first / second, **rate, "max_abs_diff": diff}


def run(args: Any) -> dict[str, Any]:
    reason = cpu_kernels.unavailable()
    if reason:
        raise SystemExit(f"pdserve's paged attention kernel is not available here: {reason}")
    threads = set_threads(args.threads)
    load = warn_if_busy(threads)
    from pdserve.engine.weights import load_model
    loaded = load_model(None, progress=False)
    model = DecoderModel(loaded.config, loaded.state_dict, torch.device("cpu"))
    rng = random.Random(0)
    results = []
    if args.only in (None, "decode"):
        results += [measure(model, "decode", name, Case(model, rows, length, rng), args.reps)
                    for name, (rows, length) in CASES.items()]
    if args.only in (None, "prefill"):
        results += [measure(model, "prefill", name, PrefillCase(model, cached, new), args.reps)
                    for name, (cached, new) in PREFILL_CASES.items()]
    if args.only in (None, "paths"):
        results += [measure(model, "paths", name, PrefillCase(model, cached, new), args.reps)
                    for name, (cached, new) in PATH_CASES.items()]
    return {"cases": results, "threads": threads, "reps": args.reps, "loadavg_at_start": load,
            "lane_rows": cpu_kernels.prefill_attention_lane_rows(), "environment": environment(threads)}


def report(r: dict[str, Any]) -> str:
    tables = []
    for kind, head, rate in (("decode", "rows x context", "native K/V GB/s"),
                             ("prefill", "new after cached", "native GFLOP/s"),
                             ("paths", "new after cached", "lanes GFLOP/s")):
        base, ours = SIDES[kind]
        rows = [[c["case"], c["context_tokens"], c[f"{base}_ms_per_layer"], c[f"{ours}_ms_per_layer"],
                 c["ratio"], c.get("avx2_kv_gb_per_s", c.get(f"{ours}_gflop_per_s")),
                 f"{c['max_abs_diff']:.1e}"]
                for c in r["cases"] if c["kind"] == kind]
        if rows:
            tables.append(format_table([head, "tokens", f"{base} ms/layer", f"{ours} ms/layer",
                                        f"{base} ÷ {ours}", rate, "max |diff|"], rows))
    return "\n\n".join(tables) + f"\n\nthe lanes path runs up to {r['lane_rows']} query rows a KV head"


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("python -m bench.attention_kernels", __doc__)
    add_threads_flag(p)
    p.add_argument("--reps", type=int, default=5,
                   help="passes over the 30 layers per kernel, alternating; medians (default: %(default)s)")
    p.add_argument("--only", choices=("decode", "prefill", "paths"), default=None,
                   help="run only the decode cases, the prefill cases (sdpa against native), or the "
                        "prefill kernel's two paths (default: all three)")
    args = check_least(p, p.parse_args(argv), {"reps": 1})
    result = run(args)
    publish(report(result), result, args.json)


if __name__ == "__main__":
    main()
