"""Builders of RequestRecords for the pure tests."""

from __future__ import annotations

from collections.abc import Sequence

from loadtest.stats import RequestRecord


def make_record(*, index: int = 0, send: float = 0.0, times: Sequence[float] = (),
                counts: Sequence[int] | None = None, end: float | None = None, status: str = "OK",
                prompt: int = 100, cached: int = 0, kind: str = "",
                error: str | None = None) -> RequestRecord:
    """A record whose messages arrived at `times` (seconds), one token each unless `counts`."""
    counts = tuple(counts) if counts is not None else (1,) * len(times)
    end = end if end is not None else (times[-1] if times else send) + 0.001
    usage = {"prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
             "completion_tokens": sum(counts)} if status == "OK" else None
    return RequestRecord(index=index, send_s=send, end_s=end, status=status, token_times_s=tuple(times),
                         token_counts=counts, usage=usage, kind=kind, error=error,
                         server_timings_ms={"ttft_ms": 3.0} if status == "OK" else None,
                         decode_worker="d0" if status == "OK" else None)
