"""`pdserve audit`: a KV audit of every worker, through the router's Admin AuditCluster call.

    worker     role     state        cached  checked  exact  mismatched  evicted  skipped  worst rel diff ...
    prefill-0  prefill  audited      96      96       40     0           0        0        4.1e-06        ...
    decode-0   decode   unreachable  -       -        -      -           -        -        -              ...

Each worker recomputes a sample of its cached blocks (all with --sample 0) from their token
prefix and compares them with the stored bytes (pdserve/engine/audit.py); a block that differs
is evicted and unpublished. The rule used and any unreachable worker's error follow the table.

Exit status: 0 every worker audited, nothing mismatched; 1 a mismatch was found on some worker;
3 nothing mismatched, but not everything was audited (the router or a worker did not answer, or
a worker's audit ran out of time). Usage errors exit 2, as in every pdserve command.
No torch: only gRPC.
"""

from __future__ import annotations

import argparse
import json
import sys

import grpc
from google.protobuf.json_format import MessageToDict

from pdserve.client_security import security_from_args
from protos.pdserve.v1 import admin_pb2, admin_pb2_grpc

COLUMNS = ("worker", "role", "state", "cached", "checked", "exact", "mismatched", "evicted", "skipped",
           "worst rel diff", "time")
EXIT_CLEAN, EXIT_MISMATCH, EXIT_INCOMPLETE = 0, 1, 3


def run_audit(args: argparse.Namespace) -> int:
    with security_from_args(args).open_channel(args.router, internal=False) as channel:
        try:
            reply = admin_pb2_grpc.AdminStub(channel).AuditCluster(
                admin_pb2.AuditClusterRequest(sample=args.sample), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{e.code().name}: cannot audit the cluster through {args.router}: {e.details()}",
                  file=sys.stderr)
            return EXIT_INCOMPLETE
    print(json.dumps(MessageToDict(reply), indent=2) if args.json else render(reply), flush=True)
    return exit_status(reply)


def exit_status(reply: admin_pb2.AuditClusterReply) -> int:
    if any(w.audit.mismatched for w in reply.workers):
        return EXIT_MISMATCH
    if any(w.state != "audited" or not w.audit.complete for w in reply.workers):
        return EXIT_INCOMPLETE
    return EXIT_CLEAN


def render(reply: admin_pb2.AuditClusterReply) -> str:
    rows = [COLUMNS, *(worker_row(w) for w in reply.workers)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    if not reply.workers:
        lines.append("(no live workers registered)")
    for rule in dict.fromkeys(w.audit.rule for w in reply.workers if w.state == "audited"):
        lines.append(f"rule: {rule}")
    lines += [f"{w.worker_id}: {w.error}" for w in reply.workers if w.state != "audited"]
    lines += [f"{w.worker_id}: ran out of time; checked what it could" for w in reply.workers
              if w.state == "audited" and not w.audit.complete]
    mismatched = sum(w.audit.mismatched for w in reply.workers)
    lines.append(f"{mismatched} mismatched block{'s' * (mismatched != 1)}" if mismatched else
                 "no mismatch")
    return "\n".join(lines)


def worker_row(w: admin_pb2.WorkerAudit) -> tuple[str, ...]:
    if w.state != "audited":
        return (w.worker_id, w.role, w.state, *("-",) * (len(COLUMNS) - 3))
    a = w.audit
    state = w.state if a.complete else "partial"
    worst = f"{a.max_rel_diff:.1e}" if a.checked else "-"
    return (w.worker_id, w.role, state, str(a.cached_blocks), str(a.checked), str(a.exact), str(a.mismatched),
            str(a.evicted), str(a.skipped), worst, f"{a.elapsed_ms / 1e3:.1f} s")
