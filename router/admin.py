"""The Admin service: the whole cluster in one call, for `pdserve status`, `pdserve audit` and operators.

ClusterStatus fans a Status RPC out to every worker the router knows (in parallel, each
with a short deadline) and returns them with the router's own view; a worker that does
not answer is listed as unreachable rather than failing the call.

AuditCluster fans Worker.Audit (the KV audit, pdserve/engine/audit.py) out the same way, on
its own threads so a long audit never delays ClusterStatus; each worker gets the Admin call's
remaining time less a second (AUDIT_TIMEOUT_S when the call has no deadline), and one that does
not answer is listed as unreachable with the gRPC error.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc

from pdserve.index.breaker import BreakerState
from protos.pdserve.v1 import admin_pb2, admin_pb2_grpc, worker_pb2
from router.placement import Placer
from router.workers import WorkerDirectory, WorkerRecord

STATUS_TIMEOUT_S = 2.0
AUDIT_TIMEOUT_S = 300.0  # per worker, when the AuditCluster call itself has no deadline
AUDIT_REPLY_MARGIN_S = 1.0  # of the call's deadline, kept to gather the workers' replies
NO_DEADLINE_S = 1e9  # time_remaining() beyond this: the caller set no deadline


@dataclass(frozen=True)
class RayHome:
    """The Ray cluster (GCS address) and namespace a router runs in as an actor; empty for a router in
    the `pdserve up` process. `pdserve down --router` reads it from ClusterStatus (deploy/detached.py)."""

    address: str = ""
    namespace: str = ""


NOT_IN_RAY = RayHome()


@dataclass(frozen=True)
class RouterIdentity:
    address: str
    metrics_address: str
    routing_policy: str
    ray_home: RayHome = NOT_IN_RAY


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, directory: WorkerDirectory, placer: Placer, in_flight, identity,
                 index_accuracy: Callable[[str], float | None] = lambda worker_id: None) -> None:
        self.directory, self.placer = directory, placer
        self._index_accuracy = index_accuracy  # worker id -> the index's recent accuracy for it
        self._in_flight = in_flight  # () -> int: Generate calls being served
        self._identity = identity  # () -> RouterIdentity, known once the server has bound its ports
        self._pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="admin-status")
        self._audit_pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="admin-audit")

    def ClusterStatus(self, request, context):  # noqa: N802
        me = self._identity()
        reply = admin_pb2.ClusterStatusReply(
            router_address=me.address, metrics_address=me.metrics_address, routing_policy=me.routing_policy,
            requests_in_flight=int(self._in_flight()),
            index_available=self.placer.breaker.state is not BreakerState.OPEN,
            ray_address=me.ray_home.address, ray_namespace=me.ray_home.namespace)
        workers = sorted(self.directory.workers(), key=lambda w: (w.role != "prefill", w.worker_id))
        for view in self._pool.map(self._view, workers):
            reply.workers.append(view)
        return reply

    def _view(self, worker: WorkerRecord) -> admin_pb2.WorkerView:
        stub = self.directory.stub(worker.address)
        in_flight = self.directory.in_flight(worker.worker_id)
        try:
            status = stub.Status(worker_pb2.StatusRequest(), timeout=STATUS_TIMEOUT_S)
        except grpc.RpcError:
            known = worker_pb2.WorkerStatus(worker_id=worker.worker_id, role=worker.role,
                                            address=worker.address, epoch=worker.epoch,
                                            node=getattr(worker, "node", ""))
            view = admin_pb2.WorkerView(status=known, state="unreachable", router_in_flight=in_flight)
        else:
            state = "serving" if status.serving else "not_serving"
            view = admin_pb2.WorkerView(status=status, state=state, router_in_flight=in_flight)
        load = self.directory.load_view(worker.worker_id)
        view.load_report_seq, view.estimated_load = load.seq, load.estimate
        if load.reported is not None:
            view.reported_load = load.reported
        accuracy = self._index_accuracy(worker.worker_id)
        if accuracy is not None:
            view.index_accuracy = accuracy
        return view

    def AuditCluster(self, request, context):  # noqa: N802
        remaining = context.time_remaining()
        # NOTE: gRPC gives a call without a deadline about 2**63 s remaining
        timeout = (AUDIT_TIMEOUT_S if remaining is None or remaining > NO_DEADLINE_S
                   else max(remaining - AUDIT_REPLY_MARGIN_S, remaining / 2))
        workers = sorted(self.directory.workers(), key=lambda w: (w.role != "prefill", w.worker_id))
        audits = self._audit_pool.map(lambda w: self._audit(w, request.sample, timeout), workers)
        return admin_pb2.AuditClusterReply(workers=list(audits))

    def _audit(self, worker: WorkerRecord, sample: int, timeout: float) -> admin_pb2.WorkerAudit:
        out = admin_pb2.WorkerAudit(worker_id=worker.worker_id, role=worker.role, address=worker.address)
        try:
            audit = self.directory.stub(worker.address).Audit(worker_pb2.AuditRequest(sample=sample),
                                                              timeout=timeout)
        except grpc.RpcError as e:
            out.state, out.error = "unreachable", f"{e.code().name}: {e.details()}"
            return out
        out.state = "audited"
        out.audit.CopyFrom(audit)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._audit_pool.shutdown(wait=False, cancel_futures=True)
