"""The router's Prometheus metrics: what clients experienced, measured at the front door.

Every Generate call ends in exactly one `pdserve_router_requests_total{code=...}` increment
(OK, INVALID_ARGUMENT, CANCELLED, ...), so a load test's own counts can be checked against
this endpoint. Latencies are from the router's receipt of the request:
    ttft  receipt -> first token sent        itl  gap between token-carrying messages
    e2e   receipt -> last message sent       decision  tokenize + index match + score
    migration_gap  the last token before a stream broke -> the first token after it (router/service.py)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.metrics import LATENCY_BUCKETS

DECISION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_router_requests", "Generate calls finished, by gRPC status code",
                                ["code"], registry=r)
        self.ended_early = Counter("pdserve_router_ended_early",
                                   "Generate calls that ended other than OK, by code and the phase they "
                                   "stood in (received | placed | prefilling | decoding | migrating)",
                                   ["code", "phase"], registry=r)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens",
                                     "Prompt tokens of requests that finished OK", registry=r)
        self.cached_tokens = Counter("pdserve_router_cached_tokens",
                                     "Prompt tokens served from a prefix cache (requests that finished OK)",
                                     registry=r)
        self.generated_tokens = Counter("pdserve_router_generated_tokens",
                                        "Tokens streamed to clients (all requests)", registry=r)
        self.remote_prefills = Counter("pdserve_router_remote_prefills",
                                       "Remote prefills, by outcome (ok | fallback: prefilled on the "
                                       "decode worker after the prefill worker failed)", ["outcome"],
                                       registry=r)
        self.decode_retries = Counter("pdserve_router_decode_retries",
                                      "Requests moved to another decode worker because theirs was "
                                      "unavailable (down or draining) before the first token", registry=r)
        self.migrations = Counter("pdserve_router_migrations",
                                  "Streams continued on another decode worker after theirs broke mid-stream, "
                                  "by the status the stream broke with", ["cause"], registry=r)
        self.migration_gap = Histogram("pdserve_router_migration_gap_seconds",
                                       "From the last token before a migration to the first after it",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("pdserve_router_ttft_seconds", "Time to first token at the router",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_router_itl_seconds", "Gap between successive token messages",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_router_e2e_seconds", "Request latency, receipt to last message",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.decision = Histogram("pdserve_router_decision_seconds", "Routing decision time",
                                  buckets=DECISION_BUCKETS, registry=r)
        self.in_flight = Gauge("pdserve_router_requests_in_flight", "Generate calls being served",
                               registry=r)
        # The index's predictions against what the workers reused (router/prediction.py)
        self.predicted_tokens = Counter("pdserve_router_predicted_cached_tokens",
                                        "Cached prompt tokens the prefix index promised the worker that "
                                        "computed the prompt (requests placed by prefix)", ["worker"],
                                        registry=r)
        self.reused_tokens = Counter("pdserve_router_reused_cached_tokens",
                                     "Cached prompt tokens that worker reported reusing (the same requests)",
                                     ["worker"], registry=r)
        self.prediction_error = Histogram("pdserve_router_prediction_error_tokens",
                                          "|predicted - reused| cached tokens per request",
                                          buckets=(0, 16, 64, 256, 1024, 4096, 16384), registry=r)
        self.index_accuracy = Gauge("pdserve_router_index_accuracy",
                                    "1 - |predicted - reused| / max over the worker's recent requests",
                                    ["worker"], registry=r)
        self.index_resyncs = Counter("pdserve_router_index_resyncs",
                                     "Workers asked to republish their index entries because the index's "
                                     "accuracy for them fell below the threshold", ["worker", "outcome"],
                                     registry=r)

    def finished(self, code: str, prompt_tokens: int, cached_tokens: int, e2e_s: float, phase: str) -> None:
        self.requests.labels(code=code).inc()
        if code != "OK":
            self.ended_early.labels(code=code, phase=phase).inc()
        self.e2e.observe(e2e_s)
        if code == "OK":
            self.prompt_tokens.inc(prompt_tokens)
            self.cached_tokens.inc(cached_tokens)
