"""The prefill role: what a WorkerServer (pdserve/worker/server.py) serves as a prefill worker.

    attach: a LayerwiseSender on the engine (sender.py): it observes every engine step
    serve:  the PrefillService (service.py), pushing KV through DecodeChannels (channels.py),
            wrapped by the fault injector when the config has a fault plan (faults.py), only
            to the decode targets the registry lists (peers.py)
    status: bytes and outcomes of the transfers it sent, blocks its transfers pin
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pdserve.engine.llm_engine import LLMEngine
from pdserve.kvwire import KVLayout, kv_blocks_path
from pdserve.transfer.channel import KVChannel
from pdserve.transfer.frames import KVFrames
from pdserve.worker.service import WorkerParts
from prefill_worker.channels import DecodeChannels, GrpcKVChannel
from prefill_worker.faults import FaultInjector, FaultPlan
from prefill_worker.peers import AnyDecodeTarget, DecodeTargets
from prefill_worker.sender import LayerwiseSender
from prefill_worker.service import PrefillServicer
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillConfig:
    frames: KVFrames = field(default_factory=KVFrames)  # how transfers are cut into LAYER frames
    transfer_timeout_s: float | None = None  # cap on one KV push; None: the Prefill call's remaining time
    # Debug only: inject faults into this worker's outgoing KV transfers (faults.py). Set only by
    # code that builds the config; nothing reads it from the environment.
    fault_plan: FaultPlan | None = None

    def __post_init__(self) -> None:
        if self.transfer_timeout_s is not None and self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s must be > 0 seconds (None: the Prefill call's deadline), "
                             f"got {self.transfer_timeout_s}")


class PrefillRole:
    name = "prefill"
    limited_services = (worker_pb2.DESCRIPTOR.services_by_name["PrefillService"],)

    def __init__(self, config: PrefillConfig | None = None, *, decode_targets: DecodeTargets | None = None,
                 dial: Callable[[str], KVChannel] | None = None,
                 fault_sleep: Callable[[float], None] = time.sleep) -> None:
        """decode_targets: where Prefill may push KV (the Ray actor gives the registry's live decode
        workers; None: anywhere, for a worker built without a registry). dial: how a KV channel to
        a decode worker address is made (None: gRPC with the worker's security and keepalive; a
        test hands in an in-process channel). fault_sleep: what a DELAY fault waits with (a test
        holds a transfer on an event with it)."""
        self.config = config or PrefillConfig()
        self.decode_targets = decode_targets or AnyDecodeTarget()
        self._dial = dial
        self.faults = (FaultInjector(self.config.fault_plan, sleep=fault_sleep)
                       if self.config.fault_plan is not None else None)
        self.sender: LayerwiseSender | None = None
        self.observer: LayerwiseSender | None = None
        self.channels: DecodeChannels | None = None
        self.servicer: PrefillServicer | None = None

    def attach(self, engine: LLMEngine, layout: KVLayout) -> None:
        self.sender = self.observer = LayerwiseSender(engine, layout, self.config.frames.max_chunk_bytes)
        log.info("KV frames are packed on the %s path", kv_blocks_path(engine.kv_cache))

    def serve(self, server: grpc.Server, parts: WorkerParts) -> None:
        assert self.sender is not None, "attach() the role to an engine first"
        dial = self._dial or (lambda target: GrpcKVChannel(target, parts.security, parts.connections))
        self.channels = DecodeChannels(dial, self.faults)
        self.servicer = PrefillServicer(parts, self.sender, self.channels, self.decode_targets,
                                        self.config.transfer_timeout_s)
        worker_pb2_grpc.add_PrefillServiceServicer_to_server(self.servicer, server)

    def fill_status(self, status: worker_pb2.WorkerStatus) -> None:
        if self.servicer is not None:
            self.servicer.fill_status(status)

    def close(self) -> None:
        if self.channels is not None:
            self.channels.close()
