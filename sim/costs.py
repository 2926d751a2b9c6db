"""The cost model: how long one engine step takes, and one KV transfer.

One step of a worker runs prefill chunks and decode tokens together (the engine batches them), so

    step_s = base_s
           + prefill_token_s   * (prefill tokens in the step)
           + prefill_attn_s    * sum over chunks of (chunk tokens x context they attend to) / 1000
           + decode_seq_s      * (decoding sequences in the step)
           + decode_context_s  * (total context of the decoding sequences) / 1000

where a chunk of n new tokens after c cached/computed ones attends to c + n/2 tokens on average.
A decode step on a GPU is memory-bound: its cost is nearly flat in batch size (decode_seq_s small
next to base_s), which is what makes disaggregation pay there; on this CPU it is not.

    transfer_s = frames x frame_latency_s + bytes / bandwidth_bytes_per_s,   frames = layers

The hardware block says how big the KV is (bytes per token, blocks per worker). Loaded from and
written as JSON (`pdserve sim calibrate` writes one; sim/data/h100_llama8b.json is the GPU one).
"""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) >= 0:
                raise ValueError(f"step cost {f.name} must be >= 0 seconds, got {getattr(self, f.name)}")


@dataclass(frozen=True)
class TransferCosts:
    bandwidth_bytes_per_s: float
    frame_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or self.frame_latency_s < 0:
            raise ValueError("transfer: bandwidth_bytes_per_s must be > 0 and frame_latency_s >= 0")


@dataclass(frozen=True)
class Hardware:
    """The model and memory a worker has: what the KV formula (docs/architecture.md) needs."""

    kv_bytes_per_token: int
    num_layers: int
    num_blocks: int  # KV blocks per worker
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64

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

    def step_s(self, prefill: list[tuple[int, int]], decode_seqs: int, decode_context: int) -> float:
        """prefill: (new tokens, tokens before them) per chunk; decode_context: their total tokens."""
        s = self.step
        new = sum(n for n, _ in prefill)
        attn = sum(n * (c + n / 2) for n, c in prefill) / 1000
        return (s.base_s + s.prefill_token_s * new + s.prefill_attn_s * attn
                + s.decode_seq_s * decode_seqs + s.decode_context_s * decode_context / 1000)

    def transfer_s(self, tokens: int) -> float:
        """Time to ship the KV of `tokens` tokens, one frame per layer."""
        t, hw = self.transfer, self.hardware
        if tokens <= 0:
            return 0.0
        return hw.num_layers * t.frame_latency_s + tokens * hw.kv_bytes_per_token / t.bandwidth_bytes_per_s

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "source": self.source, "step": asdict(self.step),
                "transfer": asdict(self.transfer), "hardware": asdict(self.hardware)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostModel:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"cost file schema is {data.get('schema')!r}; this simulator reads {SCHEMA!r}")
        return cls(StepCosts(**data["step"]), TransferCosts(**data["transfer"]), Hardware(**data["hardware"]),
                   data.get("source", {}))


def load_costs(path: str | Path) -> CostModel:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"cost file {p} not found; write one with `pdserve sim calibrate --out {p}` "
                                "or use sim/data/h100_llama8b.json")
    return CostModel.from_json(json.loads(p.read_text()))


def save_costs(model: CostModel, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(model.to_json(), indent=2) + "\n")
