"""A whole worker (WorkerServer) in another process, under multiprocessing 'spawn': to be
SIGKILLed while it streams, or to put a real process boundary between a prefill and a decode
worker. The control pipe only starts and stops it; requests and KV cross its gRPC port.
"""

from __future__ import annotations

import multiprocessing as mp

import grpc
import torch

from protos.pdserve.v1 import worker_pb2
from tests.helpers.workers import WorkerStubs

SPAWN = mp.get_context("spawn")


def _worker_main(conn, model_path: str | None, role: str, num_blocks: int, role_kwargs: dict) -> None:
    """A whole WorkerServer of the role; answers its address, then waits."""
    from decode_worker.role import DecodeConfig, DecodeRole
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.weights import load_model
    from pdserve.worker.server import WorkerConfig, WorkerServer
    from prefill_worker.role import PrefillConfig, PrefillRole

    torch.set_num_threads(1)
    engine = EngineConfig(cache=CacheConfig(num_blocks=num_blocks), device="cpu")
    served = (PrefillRole(PrefillConfig(**role_kwargs)) if role == "prefill"
              else DecodeRole(DecodeConfig(**role_kwargs)))
    worker = WorkerServer(WorkerConfig(role, engine, metrics_port=None), served,
                          load_model(model_path, progress=False))
    conn.send((worker.config.worker_id, worker.start()))
    conn.recv()  # "stop"; or the test kills us
    worker.stop()


class WorkerProcess:
    """A worker of `role` in another process (model_path None: SmolLM2). role_kwargs go to its
    PrefillConfig or DecodeConfig (a FaultPlan among them: it is plain frozen data, so it crosses
    the spawn boundary)."""

    def __init__(self, model_path: str | None, role: str, num_blocks: int = 128, **role_kwargs) -> None:
        self._conn, child = SPAWN.Pipe()
        self.process = SPAWN.Process(target=_worker_main,
                                     args=(child, model_path, role, num_blocks, role_kwargs), daemon=True)
        self.process.start()
        if not self._conn.poll(180):
            self.process.kill()
            raise TimeoutError("worker process did not start within 180 s")
        self.worker_id, self.address = self._conn.recv()
        self._channel = grpc.insecure_channel(self.address)
        self.stub = WorkerStubs(self._channel)

    def status(self) -> worker_pb2.WorkerStatus:
        return self.stub.Status(worker_pb2.StatusRequest(), timeout=10)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        self._channel.close()
        if self.process.is_alive():
            self._conn.send("stop")
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
