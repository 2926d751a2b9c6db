"""Each tier's capacity and use reach the Status reply, the status table and /metrics."""

from __future__ import annotations

from pdserve.engine.block_pool import TierUsage
from pdserve.engine.events import Tier
from pdserve.status_cli import COLUMNS, kernel_reasons, worker_row
from pdserve.worker.metrics import status_metrics
from pdserve.worker.service import fill_tiers
from protos.pdserve.v1 import admin_pb2, worker_pb2


def test_tier_usage_fills_status_table_and_metrics():
    status = worker_pb2.WorkerStatus(worker_id="d0", num_blocks=10, used_blocks=2,
                                     host_cached_tokens_total=64)
    fill_tiers(status, [TierUsage(Tier.DEVICE, 10, 2), TierUsage(Tier.HOST, 40, 7),
                        TierUsage(Tier.DISK, 400, 3)])
    assert (status.host_blocks, status.host_used_blocks) == (40, 7)
    assert (status.disk_blocks, status.disk_used_blocks) == (400, 3)
    row = dict(zip(COLUMNS, worker_row(admin_pb2.WorkerView(status=status, state="live"))))
    assert row["host tier"] == "7/40" and row["disk tier"] == "3/400"
    m = status_metrics(status)
    assert m["pdserve_worker_kv_host_blocks"][2] == {"capacity": 40, "used": 7}
    assert m["pdserve_worker_tier_hit_tokens"][2]["host"] == 64
    off = dict(zip(COLUMNS, worker_row(admin_pb2.WorkerView(status=worker_pb2.WorkerStatus(num_blocks=1),
                                                               state="live"))))
    assert off["host tier"] == "off"


def test_the_status_table_names_each_workers_kernels_and_says_why_once_per_choice():
    def view(worker_id: str, linear: str, reason: str) -> admin_pb2.WorkerView:
        status = worker_pb2.WorkerStatus(worker_id=worker_id, num_blocks=1)
        status.kernels.add(setting="linear", kernel=linear, reason=reason)
        status.kernels.add(setting="attention", kernel="sdpa", reason="set: attention_kernel sdpa")
        return admin_pb2.WorkerView(status=status, state="live")

    native = "auto: AVX-512 CPU, extension built"
    matmul = "set: linear_kernel matmul"
    workers = [view("p0", "native", native), view("d0", "native", native), view("d1", "matmul", matmul)]
    assert dict(zip(COLUMNS, worker_row(workers[2])))["kernels"] == "matmul/sdpa"
    assert kernel_reasons(workers) == [
        f"kernels on p0, d0: linear native ({native}); attention sdpa (set: attention_kernel sdpa)",
        f"kernels on d1: linear matmul ({matmul}); attention sdpa (set: attention_kernel sdpa)"]
    unknown = admin_pb2.WorkerView(status=worker_pb2.WorkerStatus(num_blocks=1), state="live")
    assert dict(zip(COLUMNS, worker_row(unknown)))["kernels"] == "-" and kernel_reasons([unknown]) == []
