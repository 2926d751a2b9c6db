"""A worker's Prometheus metrics.

Latency histograms are observed by the Worker service as tokens leave, and the engine step's
duration by the engine loop after each step that had work (it shows whether anything, such as
a slow index store, makes the step wait); everything else
(queue depth, KV blocks, token totals, transfer bytes and outcomes) is read from the
worker's own Status at scrape time, so the metrics endpoint and the Status RPC can never
disagree.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram

from pdserve.metrics import LATENCY_BUCKETS, SnapshotCollector
from protos.pdserve.v1 import worker_pb2

TRANSFER_OK = "done"  # the receiver's outcome for a transfer that completed


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve_worker_ttft_seconds",
                              "Request receipt to its first token on this worker (Decode and Prefill)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_worker_itl_seconds", "Gap between successive Decode messages",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.step_seconds = Histogram("pdserve_worker_step_seconds",
                                      "Duration of one engine step that had work (batch forward, sampling, "
                                      "KV event hand-off)", buckets=LATENCY_BUCKETS, registry=r)

    def read_status_from(self, status: Callable[[], worker_pb2.WorkerStatus]) -> None:
        self.registry.register(SnapshotCollector(lambda: status_metrics(status())))


def status_metrics(s: worker_pb2.WorkerStatus) -> dict[str, tuple]:
    failures = {k: v for k, v in s.transfer_outcomes.items() if k != TRANSFER_OK}
    return {
        "pdserve_worker_requests_waiting": ("gauge", "Requests queued for the engine", s.waiting_requests),
        "pdserve_worker_requests_running": ("gauge", "Requests the engine is running", s.active_requests),
        "pdserve_worker_kv_blocks": ("gauge", "KV blocks by state (used: referenced by a request; "
                                     "cached: free but holding a reusable prefix; free: all unreferenced)",
                                     {"total": s.num_blocks, "used": s.used_blocks, "free": s.free_blocks,
                                      "cached": s.cached_blocks}, "state"),
        "pdserve_worker_kv_host_blocks": ("gauge", "Blocks of the host-memory KV tier (capacity 0: off)",
                                          {"capacity": s.host_blocks, "used": s.host_used_blocks}, "state"),
        "pdserve_worker_kv_disk_blocks": ("gauge", "Blocks of the disk KV tier (capacity 0: off)",
                                          {"capacity": s.disk_blocks, "used": s.disk_used_blocks}, "state"),
        "pdserve_worker_tier_hit_tokens": ("counter", "Of the prefix-hit tokens, those loaded back from a "
                                           "lower tier (a copy, not a recompute), by tier",
                                           {"host": s.host_cached_tokens_total,
                                            "disk": s.disk_cached_tokens_total}, "tier"),
        "pdserve_worker_parked_transfers": ("gauge", "Received KV waiting for its Decode call",
                                            s.parked_transfers),
        "pdserve_worker_held_blocks": ("gauge", "Block references outgoing KV transfers hold (pinned until "
                                       "sent)", s.held_blocks),
        "pdserve_worker_prompt_tokens": ("counter", "Prompt tokens of requests finished here",
                                         s.prompt_tokens_total),
        "pdserve_worker_prefix_hit_tokens": ("counter", "Prompt tokens served from this worker's prefix "
                                             "cache", s.cached_tokens_total),
        "pdserve_worker_generated_tokens": ("counter", "Tokens generated here", s.generated_tokens_total),
        "pdserve_worker_preemptions": ("counter", "Times a request here lost its KV blocks to a newer one's "
                                       "need and was recomputed later", s.preemptions_total),
        "pdserve_worker_kv_bytes_sent": ("counter", "KV bytes pushed to decode workers", s.bytes_sent),
        "pdserve_worker_kv_bytes_received": ("counter", "KV bytes received from prefill workers",
                                             s.bytes_received),
        "pdserve_worker_kv_transfers_received": ("counter", "Incoming KV transfers by outcome",
                                                 dict(s.transfer_outcomes), "outcome"),
        "pdserve_worker_kv_transfer_failures": ("counter", "Incoming KV transfers that failed (any reason)",
                                                sum(failures.values())),
        "pdserve_worker_kv_transfers_sent": ("counter", "Outgoing KV transfers by outcome",
                                             dict(s.send_outcomes), "outcome"),
        "pdserve_worker_kv_audited_blocks": ("counter", "Cached KV blocks the audit compared with their "
                                             "recompute (Audit RPC and background scrubber)",
                                             s.kv_audited_blocks_total),
        "pdserve_worker_kv_audit_mismatches": ("counter", "Cached KV blocks whose stored bytes failed the "
                                               "audit's comparison with their recompute",
                                               s.kv_audit_mismatches_total),
        "pdserve_worker_kv_audit_evicted_blocks": ("counter", "Blocks the audit took out of the prefix cache "
                                                   "and the index", s.kv_audit_evicted_total),
        "pdserve_worker_kv_audit_seconds": ("counter", "Wall time spent in KV audits",
                                            s.kv_audit_seconds_total),
    }
