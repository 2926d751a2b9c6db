"""The cost model: how long one engine step takes, and one KV transfer.

One step of a worker runs prefill chunks and decode tokens together (the engine batches them), so

    step_s = base_s
           + prefill_token_s   * (prefill tokens in the step)
           + prefill_attn_s    * sum over chunks of (chunk tokens x context they attend to) / 1000
           + decode_seq_s      * (decoding sequences in the step)
           + decode_context_s  * (total context of the decoding sequences) / 1000

           + token_curve(prefill tokens + decoding sequences)

where a chunk of n new tokens after c cached/computed ones attends to c + n/2 tokens on average.
A decode step on a GPU is memory-bound: its cost is nearly flat in batch size (decode_seq_s small
next to base_s), which is what makes disaggregation pay there; on this CPU it is not.

token_curve: the cost of the step's matmuls as a function of the rows they multiply (every prefill
token and decoding sequence is one row), given as measured knots (rows, seconds) and interpolated
linearly between them (extrapolated along the last segment past the last knot). It is how a
calibrated CPU file describes what a line cannot: on this CPU a 1-row step reads the weights once
through a fast matrix-vector kernel (~40 ms at 1 thread) while 4 rows already take ~3x that through
the matrix-matrix kernel, and 4 and 8 rows cost about the same. A calibrated file sets the curve and
leaves base_s, prefill_token_s at 0; the GPU file has no curve and uses the linear terms alone.

shared_machine_slowdown: while another simulated worker on the same machine runs a step at the same
time, a step takes this fraction longer over the time they overlap, and so does the other's (CPU
workers sharing one machine's cores, caches and memory bandwidth; `pdserve sim calibrate` measures
it as two engine processes stepping together against one alone, less 1, and sets the hardware's
workers_per_machine to 2; 0 and 1 where each worker has its own GPU). The simulator puts workers on
machines in order, workers_per_machine to a machine: prefill-0, prefill-1, ..., then decode-0, ...

spread: how much steps of the same shape vary. A calibrated file keeps, for every step it timed, the
measured time ÷ the formula's (sorted); the simulator multiplies each step's formula time by one of
them, drawn by the worker's seeded generator (sim/worker.py), so ITL and TTFT get the tails the
machine's own steps have (the jitter of one engine alone: the calibration runs one). Empty (the
GPU file, and files calibrated before it): every step takes the formula's time.

    transfer_s = frames x frame_latency_s + bytes / bandwidth_bytes_per_s,   frames = layers

request.overhead_s: a request's time outside the workers' steps before its first token (the client's
and the router's gRPC hops, tokenisation, placement, the first token's way back), added once, as a
delay between its arrival and its placement. `pdserve sim calibrate --in-cluster` measures it: the
median, over its loads' requests, of the client's TTFT less what the worker reported of it (its
prefill_ms and transfer_ms); 0 in an engine-alone file, which sees no router.

The hardware block says how big the KV is (bytes per token, blocks per worker). Loaded from and
written as JSON (`pdserve sim calibrate` writes one; sim/data/h100_llama8b.json is the GPU one).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

SCHEMA = "pdserve.sim.costs/1"


@dataclass(frozen=True)
class StepCosts:
    base_s: float
    prefill_token_s: float
    prefill_attn_s: float = 0.0
    decode_seq_s: float = 0.0
    decode_context_s: float = 0.0
    token_curve: tuple[tuple[int, float], ...] = ()  # (rows in the step, seconds), rows increasing from 1
    shared_machine_slowdown: float = 0.0  # a fraction, not seconds (the module's docstring)
    spread: tuple[float, ...] = ()  # measured ÷ formula step times, sorted (the module's docstring)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name not in ("token_curve", "spread") and not getattr(self, f.name) >= 0:
                raise ValueError(f"step cost {f.name} must be >= 0 seconds, got {getattr(self, f.name)}")
        knots = tuple((int(rows), float(s)) for rows, s in self.token_curve)  # JSON gives lists
        object.__setattr__(self, "token_curve", knots)
        rows = [r for r, _ in knots]
        if knots and (rows[0] < 1 or any(b <= a for a, b in zip(rows, rows[1:]))
                      or not all(s >= 0 for _, s in knots)):
            raise ValueError(f"token_curve must be (rows, seconds) knots with rows increasing from >= 1 and "
                             f"seconds >= 0, got {list(knots)}")
        spread = tuple(sorted(float(x) for x in self.spread))
        object.__setattr__(self, "spread", spread)
        if spread and not spread[0] > 0:
            raise ValueError(f"spread must hold ratios > 0, got {spread[0]}")

    def spread_factor(self, u: float) -> float:
        """The step-time factor at quantile u in [0, 1) of the spread; 1 without one."""
        return self.spread[min(int(u * len(self.spread)), len(self.spread) - 1)] if self.spread else 1.0

    def curve_s(self, rows: int) -> float:
        """token_curve at `rows` (0 without a curve or rows): linear between knots, and along the
        last segment past the last knot (the first knot's value below it)."""
        knots = self.token_curve
        if not knots or rows <= 0:
            return 0.0
        i = bisect.bisect_left(knots, rows, key=lambda k: k[0])
        if i < len(knots) and knots[i][0] == rows:
            return knots[i][1]
        if i == 0 or len(knots) == 1:
            return knots[0][1]
        (r0, s0), (r1, s1) = knots[i - 1:i + 1] if i < len(knots) else knots[-2:]
        return max(0.0, s0 + (s1 - s0) * (rows - r0) / (r1 - r0))


@dataclass(frozen=True)
class TransferCosts:
    bandwidth_bytes_per_s: float
    frame_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or self.frame_latency_s < 0:
            raise ValueError("transfer: bandwidth_bytes_per_s must be > 0 and frame_latency_s >= 0")


@dataclass(frozen=True)
class RequestCosts:
    overhead_s: float = 0.0  # the module's docstring

    def __post_init__(self) -> None:
        if not self.overhead_s >= 0:
            raise ValueError(f"request overhead_s must be >= 0 seconds, got {self.overhead_s}")


@dataclass(frozen=True)
class Hardware:
    """The model and memory a worker has: what the KV formula (docs/architecture.md) needs."""

    kv_bytes_per_token: int
    num_layers: int
    num_blocks: int  # KV blocks per worker
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    workers_per_machine: int = 1  # workers that share one machine (shared_machine_slowdown); 1 for a GPU each

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"hardware {f.name} must be >= 1, got {getattr(self, f.name)}")


@dataclass(frozen=True)
class CostModel:
    step: StepCosts
    transfer: TransferCosts
    hardware: Hardware
    source: dict[str, Any] = field(default_factory=dict, compare=False)  # where the numbers came from
    request: RequestCosts = RequestCosts()

    def step_s(self, prefill: list[tuple[int, int]], decode_seqs: int, decode_context: int) -> float:
        """prefill: (new tokens, tokens before them) per chunk; decode_context: their total tokens."""
        s = self.step
        new = sum(n for n, _ in prefill)
        attn = sum(n * (c + n / 2) for n, c in prefill) / 1000
        return (s.base_s + s.prefill_token_s * new + s.prefill_attn_s * attn
                + s.decode_seq_s * decode_seqs + s.decode_context_s * decode_context / 1000
                + s.curve_s(new + decode_seqs))

    def transfer_s(self, tokens: int) -> float:
        """Time to ship the KV of `tokens` tokens, one frame per layer."""
        t, hw = self.transfer, self.hardware
        if tokens <= 0:
            return 0.0
        return hw.num_layers * t.frame_latency_s + tokens * hw.kv_bytes_per_token / t.bandwidth_bytes_per_s

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "source": self.source, "step": asdict(self.step),
                "transfer": asdict(self.transfer), "hardware": asdict(self.hardware),
                "request": asdict(self.request)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostModel:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"cost file schema is {data.get('schema')!r}; this simulator reads {SCHEMA!r}")
        return cls(StepCosts(**data["step"]), TransferCosts(**data["transfer"]), Hardware(**data["hardware"]),
                   data.get("source", {}), RequestCosts(**data.get("request", {})))  # files before it: none


def load_costs(path: str | Path) -> CostModel:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"cost file {p} not found; write one with `pdserve sim calibrate --out {p}` "
                                "or use sim/data/h100_llama8b.json")
    return CostModel.from_json(json.loads(p.read_text()))


def save_costs(model: CostModel, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(model.to_json(), indent=2) + "\n")
