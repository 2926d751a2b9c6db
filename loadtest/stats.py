"""Per-request records -> the report's numbers. Pure: no I/O, no clock.

Definitions (times are seconds from the start of the run on the client's monotonic clock;
reported latencies are milliseconds):

- TTFT: receipt of the first message carrying tokens - send time.
- ITL: the gaps between successive token-carrying messages. NOTE: a message may carry k > 1
  tokens; its gap is divided evenly into k samples of gap/k, so the ITL samples of a request
  sum to (last - first token message) and number (output tokens - tokens of the first
  message). ITL percentiles pool the samples of all requests (as vLLM does).
- TPOT: (e2e - ttft) / (output tokens - 1), one sample per request with >= 2 output tokens.
- E2E: receipt of the stream's end - send time.
- Goodput: requests that succeeded with TTFT <= slo.ttft_ms and ITL <= slo.itl_ms, where a
  request's ITL is the slo.itl_stat (p99 by default) of its own ITL samples; a request with a
  single output token has none and meets the ITL objective. Reported per second of the run
  and as a fraction of the requests sent.
- Prefix hit rate: sum(usage.cached_tokens) / sum(usage.prompt_tokens) over the requests that
  succeeded (the final message's usage).
- Errors: failed requests counted by gRPC status name.
- Percentiles interpolate linearly between the closest ranks (numpy's default).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

OK = "OK"
SCHEMA = "pdserve.loadtest/1"
ITL_STATS = ("p99", "max", "mean")
TIMELINE_BINS = 60


@dataclass(frozen=True)
class SLO:
    ttft_ms: float = 2000.0
    itl_ms: float = 200.0
    itl_stat: str = "p99"  # which statistic of a request's own ITL samples must meet itl_ms

    def __post_init__(self) -> None:
        if self.itl_stat not in ITL_STATS:
            raise ValueError(f"itl_stat must be one of {', '.join(ITL_STATS)}, got {self.itl_stat!r}")
        if not (self.ttft_ms > 0 and self.itl_ms > 0):
            raise ValueError("SLO objectives must be > 0 ms")


@dataclass(frozen=True)
class RequestRecord:
    """What happened to one request, as the load generator saw it."""

    index: int  # the spec's index in the workload
    send_s: float
    end_s: float
    status: str  # gRPC status name; "OK" when the stream ended with its final message
    token_times_s: tuple[float, ...] = ()  # receipt of each message that carried tokens
    token_counts: tuple[int, ...] = ()  # tokens in each of those messages
    usage: Mapping[str, int] | None = None  # the final message's usage
    server_timings_ms: Mapping[str, float] | None = None  # the final message's timings
    prefill_worker: str | None = None  # None: prefilled on the decode worker (or failed)
    decode_worker: str | None = None
    finish_reason: str | None = None
    error: str | None = None  # the status message of a failed request
    max_tokens: int = 0
    kind: str = ""
    conversation: int | None = None
    turn: int = 0

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def output_tokens(self) -> int:
        return sum(self.token_counts)

    @property
    def ttft_ms(self) -> float | None:
        return (self.token_times_s[0] - self.send_s) * 1e3 if self.token_times_s else None

    @property
    def e2e_ms(self) -> float:
        return (self.end_s - self.send_s) * 1e3

    @property
    def itl_ms(self) -> list[float]:
        out: list[float] = []
        for prev, now, count in zip(self.token_times_s, self.token_times_s[1:], self.token_counts[1:]):
            out.extend([(now - prev) * 1e3 / count] * count)
        return out

    @property
    def tpot_ms(self) -> float | None:
        ttft, n = self.ttft_ms, self.output_tokens
        return (self.e2e_ms - ttft) / (n - 1) if ttft is not None and n >= 2 else None

    def as_json(self) -> dict[str, Any]:
        """One line of requests.jsonl."""
        return {"index": self.index, "kind": self.kind, "conversation": self.conversation, "turn": self.turn,
                "status": self.status, "error": self.error, "send_s": self.send_s, "end_s": self.end_s,
                "ttft_ms": self.ttft_ms, "e2e_ms": self.e2e_ms, "tpot_ms": self.tpot_ms,
                "output_tokens": self.output_tokens, "max_tokens": self.max_tokens,
                "finish_reason": self.finish_reason, "usage": dict(self.usage or {}),
                "server_timings_ms": dict(self.server_timings_ms or {}),
                "prefill_worker": self.prefill_worker, "decode_worker": self.decode_worker,
                "token_times_s": list(self.token_times_s), "token_counts": list(self.token_counts)}


# --- statistics ---------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); None for no values.

    The one percentile of the project: the benchmarks and the tests report theirs with it too."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """p50, p90, p99, mean and max of values (None when there are none), and their count."""
    return {"p50": _round(percentile(values, 50)), "p90": _round(percentile(values, 90)),
            "p99": _round(percentile(values, 99)),
            "mean": _round(sum(values) / len(values)) if values else None,
            "max": _round(max(values)) if values else None, "count": len(values)}


def request_itl_stat(record: RequestRecord, stat: str) -> float | None:
    itl = record.itl_ms
    if not itl:
        return None
    if stat == "max":
        return max(itl)
    if stat == "mean":
        return sum(itl) / len(itl)
    return percentile(itl, 99)


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    if not record.ok or record.ttft_ms is None or record.ttft_ms > slo.ttft_ms:
        return False
    itl = request_itl_stat(record, slo.itl_stat)
    return itl is None or itl <= slo.itl_ms


def prefix_hit_rate(records: Iterable[RequestRecord]) -> float | None:
    usages = [r.usage for r in records if r.ok and r.usage]
    prompt = sum(u.get("prompt_tokens", 0) for u in usages)
    return sum(u.get("cached_tokens", 0) for u in usages) / prompt if prompt else None


def errors_by_status(records: Iterable[RequestRecord]) -> dict[str, int]:
    return dict(sorted(Counter(r.status for r in records if not r.ok).items()))


def error_examples(records: Iterable[RequestRecord]) -> dict[str, str]:
    """The first message seen for each failing status, to tell what went wrong."""
    out: dict[str, str] = {}
    for r in records:
        if not r.ok:
            out.setdefault(r.status, r.error or "")
    return dict(sorted(out.items()))


def timeline(records: Sequence[RequestRecord], duration_s: float,
             bins: int = TIMELINE_BINS) -> dict[str, Any]:
    """Output tokens/s per time bin and completed (successful) requests by the end of each bin."""
    if duration_s <= 0:
        return {"bin_s": 0.0, "t_s": [], "output_tokens_per_s": [], "completed": []}
    bin_s = duration_s / bins
    tokens = [0] * bins
    ends = [0] * bins
    for r in records:
        for t, n in zip(r.token_times_s, r.token_counts):
            tokens[min(int(t / bin_s), bins - 1)] += n
        if r.ok:
            ends[min(int(r.end_s / bin_s), bins - 1)] += 1
    completed, total = [], 0
    for n in ends:
        total += n
        completed.append(total)
    return {"bin_s": _round(bin_s), "t_s": [_round((i + 1) * bin_s) for i in range(bins)],
            "output_tokens_per_s": [_round(n / bin_s) for n in tokens], "completed": completed}


# --- the report ---------------------------------------------------------------------------------

def latency_sections(records: Sequence[RequestRecord]) -> dict[str, dict[str, Any]]:
    ok = [r for r in records if r.ok]
    return {
        "ttft_ms": summarize([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "itl_ms": summarize([x for r in ok for x in r.itl_ms]),
        "tpot_ms": summarize([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "e2e_ms": summarize([r.e2e_ms for r in ok]),
    }


def build_report(records: Sequence[RequestRecord], *, duration_s: float, slo: SLO, skipped: int = 0,
                 meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The report dict (report.json). `meta` (workload, seed, arrival...) is copied in first;
    `skipped` counts multi-turn turns never sent because an earlier turn failed."""
    ok = [r for r in records if r.ok]
    good = [r for r in records if meets_slo(r, slo)]
    usages = [r.usage for r in ok if r.usage]
    output_total = sum(r.output_tokens for r in records)
    prompt_total = sum(u.get("prompt_tokens", 0) for u in usages)
    per_s = (lambda x: _round(x / duration_s)) if duration_s > 0 else (lambda x: None)
    report: dict[str, Any] = {"schema": SCHEMA, **(meta or {})}
    report.update({
        "counts": {"sent": len(records), "completed": len(ok), "failed": len(records) - len(ok),
                   "skipped": skipped},
        "duration_s": _round(duration_s),
        "requests_per_s": per_s(len(ok)),
        **latency_sections(records),
        "throughput_tokens_per_s": per_s(output_total),
        "input_tokens_per_s": per_s(prompt_total),
        "output_tokens_total": output_total,
        "prompt_tokens_total": prompt_total,
        "cached_tokens_total": sum(u.get("cached_tokens", 0) for u in usages),
        "prompt_tokens_per_request": summarize([u.get("prompt_tokens", 0) for u in usages]),
        "output_tokens_per_request": summarize([r.output_tokens for r in ok]),
        "goodput": {"requests_per_s": per_s(len(good)), "requests": len(good),
                    "fraction": _round(len(good) / len(records)) if records else None},
        "slo": {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms, "itl_criterion": slo.itl_stat,
                "rule": f"ok and ttft <= {slo.ttft_ms:g} ms and the request's {slo.itl_stat} ITL "
                        f"<= {slo.itl_ms:g} ms (no ITL samples: met)"},
        "prefix_hit_rate": _round(prefix_hit_rate(records)),
        "errors": errors_by_status(records),
        "error_examples": error_examples(records),
        "server_timings_ms": server_timings(ok),
        "workers": workers(ok),
        "by_kind": by_kind(records, slo),
        "timeline": timeline(records, duration_s),
    })
    return report


def server_timings(ok: Sequence[RequestRecord]) -> dict[str, Any]:
    """The router's own timings of the successful requests (queue, prefill, transfer, ttft)."""
    timings = [r.server_timings_ms for r in ok if r.server_timings_ms]
    names = sorted({k for t in timings for k in t})
    return {k: summarize([t[k] for t in timings if k in t]) for k in names}


def workers(ok: Sequence[RequestRecord]) -> dict[str, dict[str, int]]:
    """Successful requests by decode worker and by prefill worker ("" = prefilled on the decode worker)."""
    return {"decode": dict(sorted(Counter(r.decode_worker or "" for r in ok).items())),
            "prefill": dict(sorted(Counter(r.prefill_worker or "" for r in ok).items()))}


def by_kind(records: Sequence[RequestRecord], slo: SLO) -> dict[str, Any]:
    """Latencies per sub-population (e.g. mixed's "long" and "short"); empty with one kind."""
    kinds = sorted({r.kind for r in records})
    if len(kinds) < 2:
        return {}
    out = {}
    for kind in kinds:
        rs = [r for r in records if r.kind == kind]
        good = sum(meets_slo(r, slo) for r in rs)
        out[kind] = {"sent": len(rs), "completed": sum(r.ok for r in rs), **latency_sections(rs),
                     "goodput_fraction": _round(good / len(rs))}
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
