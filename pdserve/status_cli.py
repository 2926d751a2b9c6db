"""`pdserve status`: one table of the cluster, from the router's Admin ClusterStatus call.

    worker     role     node          state    queue  load  KV used      hit rate  ...  kernels  architecture
    prefill-0  prefill  host/1a2b3c4d serving  0/1    1     12/96 (12%)  41.0%     ...  n/n/n    gemma3
    kernels on prefill-0: linear native (auto: AVX-512 CPU, extension built); attention native (...); ...

queue is waiting/running on the worker, asked now; load is what this router scores it with: the
worker's last heartbeat report, shared by every router, plus this router's requests placed there
since (router/shared_load.py); hit rate is cached / prompt tokens over the requests
that finished on it; sent/received are KV transfer bytes; kernels are the linear/attention/pointwise
kernels its engine runs, and the lines under the table say why, once for the workers that share them;
architecture is the model family it serves (llama, mistral, qwen2, qwen3, gemma3).
No torch: only gRPC.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import grpc
from google.protobuf.json_format import MessageToDict

from pdserve.client_security import security_from_args
from pdserve.units import human_bytes
from protos.pdserve.v1 import admin_pb2, admin_pb2_grpc, worker_pb2

COLUMNS = ("worker", "role", "node", "state", "queue", "load", "KV used", "host tier", "disk tier",
           "hit rate", "index accuracy", "sent", "received", "failed", "kernels", "architecture")


def run_status(args: argparse.Namespace) -> int:
    with security_from_args(args).open_channel(args.router, internal=False) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        while True:
            try:
                reply = stub.ClusterStatus(admin_pb2.ClusterStatusRequest(), timeout=args.timeout)
            except grpc.RpcError as e:
                print(f"{e.code().name}: cannot read the cluster status from {args.router}: {e.details()}"
                      f"{_hint(e.code())}", file=sys.stderr)
                return 1
            print(json.dumps(MessageToDict(reply), indent=2) if args.json else render(reply), flush=True)
            if not args.watch:
                return 0
            time.sleep(args.watch)


def _hint(code: grpc.StatusCode) -> str:
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ("; is the router running (`pdserve up`) and is --router its address? If it serves TLS, "
                "give --tls-ca")
    return ""  # e.g. UNAUTHENTICATED: the router's message already names --api-token-file


def render(reply: admin_pb2.ClusterStatusReply) -> str:
    index = "available" if reply.index_available else "UNAVAILABLE (routing by load only)"
    head = (f"router {reply.router_address} · metrics {reply.metrics_address or 'off'} · "
            f"routing {reply.routing_policy} · {reply.requests_in_flight} in flight · prefix index {index}")
    rows = [COLUMNS, *(worker_row(w) for w in reply.workers)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    if not reply.workers:
        lines.append("(no live workers registered)")
    return "\n".join([head, *lines, *kernel_reasons(reply.workers)])


def kernel_reasons(workers) -> list[str]:
    """One line per distinct choice of kernels: the workers that run it, and why each kernel."""
    workers_of: dict[str, list[str]] = {}
    for view in workers:
        if view.status.kernels:
            workers_of.setdefault(describe_kernels(view.status), []).append(view.status.worker_id)
    return [f"kernels on {', '.join(ids)}: {why}" for why, ids in workers_of.items()]


def describe_kernels(status: worker_pb2.WorkerStatus) -> str:
    """A worker's kernels and why each, as its log says them (pdserve/engine/kernel_choice.py)."""
    return "; ".join(f"{k.setting} {k.kernel} ({k.reason})" for k in status.kernels)


def worker_row(view: admin_pb2.WorkerView) -> tuple[str, ...]:
    s = view.status
    if view.state == "unreachable":
        return (s.worker_id, s.role, s.node, view.state, *("-",) * (len(COLUMNS) - 4))
    kv = "-"
    if s.num_blocks:
        kv = f"{s.used_blocks}/{s.num_blocks} ({100 * s.used_blocks / s.num_blocks:.0f}%)"
    host = f"{s.host_used_blocks}/{s.host_blocks}" if s.host_blocks else "off"
    disk = f"{s.disk_used_blocks}/{s.disk_blocks}" if s.disk_blocks else "off"
    hit = f"{100 * s.cached_tokens_total / s.prompt_tokens_total:.1f}%" if s.prompt_tokens_total else "-"
    failed = sum(v for k, v in [*s.transfer_outcomes.items(), *s.send_outcomes.items()] if k != "done")
    accuracy = f"{view.index_accuracy:.2f}" if view.HasField("index_accuracy") else "-"
    return (s.worker_id, s.role, s.node, view.state, f"{s.waiting_requests}/{s.active_requests}",
            str(view.estimated_load), kv, host, disk, hit,
            accuracy, human_bytes(s.bytes_sent), human_bytes(s.bytes_received), str(failed),
            "/".join(k.kernel for k in s.kernels) or "-", s.architecture or "-")
