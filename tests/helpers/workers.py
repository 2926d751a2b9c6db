"""Workers as tests build, address and check them.

    worker_server      a WorkerServer of a role chosen by name (the application picks a role's Ray actor
                       class instead: prefill_worker/actor.py, decode_worker/actor.py)
    WorkerStubs        every service a worker may serve, over one channel
    worker_record      a registry record (WorkerInfo) with plausible values for the fields a test ignores
    worker_info        the registry record of a running worker, from its own Status
    wait_until_clean   the leak check every flow through in-process workers ends with
"""

from __future__ import annotations

from typing import Protocol

import grpc

from decode_worker.role import DecodeRole
from pdserve.engine.hashing import engine_salt
from pdserve.engine.weights import LoadedModel
from pdserve.index.registry import WorkerInfo
from pdserve.worker.server import Role, WorkerConfig, WorkerServer
from prefill_worker.role import PrefillRole
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.helpers.waiting import until_clean


def role_for(name: str) -> Role:
    """The default role object of that name."""
    return PrefillRole() if name == "prefill" else DecodeRole()


def worker_server(config: WorkerConfig, loaded: LoadedModel | None = None, **kwargs) -> WorkerServer:
    """A WorkerServer of config.role with that role's defaults (kwargs go to WorkerServer)."""
    return WorkerServer(config, role_for(config.role), loaded, **kwargs)


class WorkerStubs:
    """Every service a worker may serve, over one channel: Worker's calls (Abort, Status, Audit, Steps),
    Prefill (PrefillService: prefill workers) and Decode (DecodeService: decode workers)."""

    def __init__(self, channel: grpc.Channel) -> None:
        worker = worker_pb2_grpc.WorkerStub(channel)
        self.Abort, self.Status, self.Audit = worker.Abort, worker.Status, worker.Audit
        self.Steps = worker.Steps
        self.Prefill = worker_pb2_grpc.PrefillServiceStub(channel).Prefill
        self.Decode = worker_pb2_grpc.DecodeServiceStub(channel).Decode


class RunningWorker(Protocol):
    """A started worker this process can ask: a WorkerServer, or a WorkerProcess (helpers/processes.py)."""

    @property
    def address(self) -> str: ...

    def status(self) -> worker_pb2.WorkerStatus: ...


def worker_record(worker_id: str, role: str, address: str, *, epoch: int = 0, fingerprint: str = "",
                  block_size: int = 16, kv_dtype: str = "float32", num_blocks: int = 64,
                  node: str = "local", architecture: str = "llama") -> WorkerInfo:
    """A registry record as a worker publishes it: its salt is the engine salt of that fingerprint,
    family, block size and KV dtype (pdserve/engine/hashing.py)."""
    salt = engine_salt(fingerprint, block_size, kv_dtype, architecture=architecture).hex()
    return WorkerInfo(worker_id=worker_id, role=role, address=address, node=node,
                      model_fingerprint=fingerprint, block_size=block_size, kv_dtype=kv_dtype, salt=salt,
                      num_blocks=num_blocks, epoch=epoch)


def worker_info(worker: RunningWorker, epoch: int = 0) -> WorkerInfo:
    """The record a started worker registers (of that epoch): what its Status says it is."""
    s = worker.status()
    return worker_record(s.worker_id, s.role, worker.address, epoch=epoch, fingerprint=s.model_fingerprint,
                         block_size=s.block_size, num_blocks=s.num_blocks, architecture=s.architecture)


def leftovers(status: worker_pb2.WorkerStatus) -> dict[str, int]:
    """What a worker's Status shows still taken that an idle, clean worker would not have: {} when clean.
    A block cached and unreferenced counts as free; a referenced one as used."""
    taken = {"used_blocks": status.used_blocks, "parked_transfers": status.parked_transfers,
             "held_blocks": status.held_blocks, "active_requests": status.active_requests,
             "waiting_requests": status.waiting_requests,
             "blocks_not_free": status.num_blocks - status.free_blocks}
    return {name: count for name, count in taken.items() if count}


def _leftovers_of(worker: RunningWorker) -> dict[str, object]:
    left: dict[str, object] = dict(leftovers(worker.status()))
    if isinstance(worker, WorkerServer):  # in this process: the engine and the KV service too
        with worker.engine.lock:
            leaked, unfinished = worker.engine.leaked_blocks(), worker.engine.has_unfinished()
        if leaked:
            left["leaked_blocks"] = leaked
        if unfinished:
            left["unfinished_requests"] = True
        kv_servicer = getattr(worker.role, "kv_servicer", None)  # decode workers
        if kv_servicer is not None and (pushes := kv_servicer.pushes_in_flight()):
            left["pushes_in_flight"] = pushes
    return left


def wait_until_clean(*workers: RunningWorker, timeout_s: float = 5.0) -> None:
    """Wait until every worker is clean: no block referenced, nothing parked or held, no request or KV
    push left. A call-end callback may still be releasing just after a reply (the prefill worker lets
    go of its held blocks just after it answers), hence the wait; timeout_s=0 checks once, at once.
    AssertionError naming each worker and what it still has after timeout_s."""
    until_clean(lambda: {f"{w.status().role} {w.address}": left for w in workers
                         if (left := _leftovers_of(w))}, timeout_s)
