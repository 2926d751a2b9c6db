"""The decode role: what a WorkerServer (pdserve/worker/server.py) serves as a decode worker.

    attach: a KVReceiver on the engine (receiver.py) and the KVTransfer service in front of it,
            with its per-peer cap and time limit (kv_service.py); the stream hold of a debug fault
            plan, when the config has one (faults.py)
    serve:  KVTransfer and the DecodeService (service.py)
    status: bytes and outcomes of the transfers it received
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from decode_worker.faults import NO_HOLD, DecodeFaultPlan, StreamHold
from decode_worker.kv_service import (
    DEFAULT_MAX_PUSHES_PER_PEER,
    DEFAULT_PUSH_TIME_LIMIT_S,
    KVTransferServicer,
    add_kv_transfer_service,
)
from decode_worker.receiver import KVReceiver
from decode_worker.service import DecodeServicer
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kvwire import KVLayout, kv_blocks_path
from pdserve.worker.service import WorkerParts
from protos.pdserve.v1 import kv_transfer_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeConfig:
    parked_ttl_s: float = 30.0  # how long transferred KV waits for its Decode call
    max_pushes_per_peer: int = DEFAULT_MAX_PUSHES_PER_PEER  # incoming KV pushes at once from one peer host
    # An incoming KV push must reach END within this, whatever deadline its sender set. NOTE: a push
    # starts with its prefill (layers stream as computed), so this covers a long prompt's prefill.
    push_time_limit_s: float = DEFAULT_PUSH_TIME_LIMIT_S
    fault_plan: DecodeFaultPlan | None = None  # debug only (faults.py): None, always, in production

    def __post_init__(self) -> None:
        if self.max_pushes_per_peer < 1:
            raise ValueError(f"max_pushes_per_peer must be >= 1, got {self.max_pushes_per_peer}")
        if not self.push_time_limit_s > 0:
            raise ValueError(f"push_time_limit_s must be > 0 seconds, got {self.push_time_limit_s}")
        if self.parked_ttl_s < 0:
            raise ValueError(f"parked_ttl_s must be >= 0 seconds, got {self.parked_ttl_s}")


class DecodeRole:
    name = "decode"
    observer = None  # nothing watches a decode worker's steps
    limited_services = (worker_pb2.DESCRIPTOR.services_by_name["DecodeService"],
                        kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"])

    def __init__(self, config: DecodeConfig | None = None) -> None:
        self.config = config or DecodeConfig()
        self.receiver: KVReceiver | None = None
        self.kv_servicer: KVTransferServicer | None = None
        plan = self.config.fault_plan
        self.hold: StreamHold | None = StreamHold(plan) if plan is not None else None

    def attach(self, engine: LLMEngine, layout: KVLayout) -> None:
        c = self.config
        self.receiver = KVReceiver(engine, layout, c.parked_ttl_s)
        log.info("KV frames are verified and written on the %s path", kv_blocks_path(engine.kv_cache))
        self.kv_servicer = KVTransferServicer(self.receiver, max_pushes_per_peer=c.max_pushes_per_peer,
                                              time_limit_s=c.push_time_limit_s)

    def serve(self, server: grpc.Server, parts: WorkerParts) -> None:
        assert self.kv_servicer is not None, "attach() the role to an engine first"
        add_kv_transfer_service(self.kv_servicer, server)
        servicer = DecodeServicer(parts, self.hold or NO_HOLD)
        worker_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)

    def fill_status(self, status: worker_pb2.WorkerStatus) -> None:
        if self.receiver is not None:
            status.bytes_received = self.receiver.bytes_received
            status.transfer_outcomes.update(self.receiver.outcomes)

    def close(self) -> None:
        return None
