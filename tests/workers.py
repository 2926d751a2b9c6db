"""Workers of a role chosen by name, as tests build them (the application picks a role's Ray actor
class: prefill_worker/actor.py, decode_worker/actor.py)."""

from __future__ import annotations

import grpc

from decode_worker.role import DecodeRole
from pdserve.engine.weights import LoadedModel
from pdserve.worker.server import Role, WorkerConfig, WorkerServer
from prefill_worker.role import PrefillRole
from protos.pdserve.v1 import worker_pb2_grpc


def role_for(name: str) -> Role:
    """The default role object of that name."""
    return PrefillRole() if name == "prefill" else DecodeRole()


def worker_server(config: WorkerConfig, loaded: LoadedModel | None = None, **kwargs) -> WorkerServer:
    """A WorkerServer of config.role with that role's defaults (kwargs go to WorkerServer)."""
    return WorkerServer(config, role_for(config.role), loaded, **kwargs)


class WorkerStubs:
    """Every service a worker may serve, over one channel: Worker's calls (Abort, Status, Audit),
    Prefill (PrefillService: prefill workers) and Decode (DecodeService: decode workers)."""

    def __init__(self, channel: grpc.Channel) -> None:
        worker = worker_pb2_grpc.WorkerStub(channel)
        self.Abort, self.Status, self.Audit = worker.Abort, worker.Status, worker.Audit
        self.Prefill = worker_pb2_grpc.PrefillServiceStub(channel).Prefill
        self.Decode = worker_pb2_grpc.DecodeServiceStub(channel).Decode
