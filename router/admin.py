"""The Admin service: the whole cluster in one call, for `pdserve status` and operators.

ClusterStatus fans a Status RPC out to every worker the router knows (in parallel, each
with a short deadline) and returns them with the router's own view; a worker that does
not answer is listed as unreachable rather than failing the call.
"""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass

import grpc

from pdserve.index.breaker import BreakerState
from protos.pdserve.v1 import admin_pb2, admin_pb2_grpc, worker_pb2
from router.placement import Placer
from router.workers import WorkerDirectory, WorkerRecord

STATUS_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class RouterIdentity:
    address: str
    metrics_address: str
    routing_policy: str


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, directory: WorkerDirectory, placer: Placer, in_flight, identity) -> None:
        self.directory, self.placer = directory, placer
        self._in_flight = in_flight  # () -> int: Generate calls being served
        self._identity = identity  # () -> RouterIdentity, known once the server has bound its ports
        self._pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="admin-status")

    def ClusterStatus(self, request, context):  # noqa: N802
        me = self._identity()
        reply = admin_pb2.ClusterStatusReply(
            router_address=me.address, metrics_address=me.metrics_address, routing_policy=me.routing_policy,
            requests_in_flight=int(self._in_flight()),
            index_available=self.placer.breaker.state is not BreakerState.OPEN)
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
            return admin_pb2.WorkerView(status=known, state="unreachable", router_in_flight=in_flight)
        state = "serving" if status.serving else "not_serving"
        return admin_pb2.WorkerView(status=status, state=state, router_in_flight=in_flight)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
