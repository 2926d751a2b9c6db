"""Prometheus plumbing shared by the router and the workers.

Each server owns a CollectorRegistry (not the process-global one), so tests can run several
workers and a router in one process without metric names colliding, and a scrape of one
endpoint shows exactly one component. `MetricsEndpoint` serves a registry over HTTP at
`/metrics` on host:port (port 0 = any free port).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Seconds; spans a 10 ms decode step on a GPU to a multi-second CPU prefill.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.4, 0.6, 1.0, 1.5, 2.5, 4.0,
                   6.0, 10.0, 20.0, 40.0, 80.0)


class MetricsEndpoint:
    """HTTP /metrics for one registry; start() returns "host:port"."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry, self.host, self.port = registry, host, port
        self.address = ""
        self._server = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        self._server, self._thread = start_http_server(self.port, addr=self.host, registry=self.registry)
        self.address = f"{self.host}:{self._server.server_port}"
        return self.address

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics" if self.address else ""

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class SnapshotCollector(Collector):
    """Gauges and counters read from a snapshot function at scrape time.

    snapshot() returns {name: (kind, help, value or {label value: value}, label name)}; kind is
    "gauge" or "counter". Reading at scrape time keeps the engine's hot path free of metric
    updates: block counts and queue depths are already tracked by the engine itself.
    """

    def __init__(self, snapshot: Callable[[], dict[str, tuple]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable:
        for name, (kind, help_text, value, *label) in self._snapshot().items():
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            if isinstance(value, dict):
                metric = family(name, help_text, labels=label[:1])
                for label_value, v in sorted(value.items()):
                    metric.add_metric([label_value], v)
            else:
                metric = family(name, help_text, value=value)
            yield metric

    def describe(self) -> Iterable:
        return []


def scrape(url: str, timeout_s: float = 5.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Read a Prometheus text endpoint: {(sample name, sorted labels): value}."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(url, timeout=timeout_s) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
