"""The server-side cross-check: the router's Prometheus counters, scraped before and after a
run; the report holds their deltas next to the client's own counts.

`parse_counters` and `counter_deltas` are pure; `scrape` is the one function that does I/O.
NOTE: prometheus_client names a counter's family without `_total` and its sample with it
(`pdserve_router_requests` / `pdserve_router_requests_total`); samples are matched by name,
with or without the suffix, so either exposition style works. A counter labelled `code` is
kept per code; any other labels are summed over.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

ROUTER_COUNTERS = (
    "pdserve_router_requests_total",  # label code: the gRPC status name
    "pdserve_router_prompt_tokens_total",
    "pdserve_router_cached_tokens_total",
    "pdserve_router_generated_tokens_total",
)
BY_LABEL = "code"

if TYPE_CHECKING:
    from pdserve.security import SecurityConfig

CounterValue = float | dict[str, float]


def parse_counters(text: str, names: Sequence[str] = ROUTER_COUNTERS) -> dict[str, CounterValue]:
    """The named counters in a Prometheus text exposition; a counter not exposed is absent."""
    aliases = {alias: name for name in names for alias in (name, name.removesuffix("_total"))}
    out: dict[str, CounterValue] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = aliases.get(sample.name)
            if name is None:
                continue
            if BY_LABEL in sample.labels:
                by_code = out.setdefault(name, {})
                assert isinstance(by_code, dict)
                code = sample.labels[BY_LABEL]
                by_code[code] = by_code.get(code, 0.0) + sample.value
            else:
                current = out.get(name, 0.0)
                out[name] = (current if isinstance(current, float) else 0.0) + sample.value
    return out


def counter_deltas(before: Mapping[str, CounterValue], after: Mapping[str, CounterValue],
                   names: Sequence[str] = ROUTER_COUNTERS) -> dict[str, CounterValue | None]:
    """after - before for each name (None when the server does not expose it)."""
    out: dict[str, CounterValue | None] = {}
    for name in names:
        if name not in after:
            out[name] = None
        elif isinstance(after[name], dict):
            prior = before.get(name) or {}
            prior = prior if isinstance(prior, dict) else {}
            deltas = {code: value - prior.get(code, 0.0) for code, value in after[name].items()}
            out[name] = {code: d for code, d in sorted(deltas.items()) if d}
        else:
            prior = before.get(name, 0.0)
            out[name] = after[name] - (prior if isinstance(prior, float) else 0.0)
    return out


def discover_metrics_url(router: str, timeout_s: float = 5.0, *,
                         security: SecurityConfig | None = None) -> str | None:
    """The router's own /metrics URL, from its Admin ClusterStatus; None if it does not say (or
    refuses: Admin needs the API token, which security carries)."""
    import grpc

    from pdserve.security import SecurityConfig
    from protos.pdserve.v1 import admin_pb2, admin_pb2_grpc

    with (security or SecurityConfig()).open_channel(router, internal=False) as channel:
        try:
            reply = admin_pb2_grpc.AdminStub(channel).ClusterStatus(admin_pb2.ClusterStatusRequest(),
                                                                    timeout=timeout_s)
        except grpc.RpcError:
            return None
    return f"http://{reply.metrics_address}/metrics" if reply.metrics_address else None


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, CounterValue]:
    """GET url and parse the router counters; raises OSError / ValueError on failure."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return parse_counters(response.read().decode("utf-8"))


class MetricsProbe:
    """Scrapes before and after a run; never raises: a failure becomes the report's `error`."""

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url, self.timeout_s = url, timeout_s
        self._before: dict[str, CounterValue] | None = None
        self._error: str | None = None

    def before(self) -> None:
        self._before = self._scrape("before")

    def after(self) -> dict[str, Any]:
        """The report's `server_metrics` section: {"url", "error", and a delta per counter}."""
        after = self._scrape("after") if self._error is None else None
        if self._before is None or after is None:
            return {"url": self.url, "error": self._error}
        return {"url": self.url, "error": None, **counter_deltas(self._before, after)}

    def _scrape(self, when: str) -> dict[str, CounterValue] | None:
        try:
            return scrape(self.url, self.timeout_s)
        except (OSError, ValueError) as exc:  # URLError is an OSError
            self._error = f"scraping {self.url} {when} the run failed: {exc}"
            return None
