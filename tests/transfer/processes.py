"""Out-of-process ends for transfer tests: a decode engine behind a real gRPC KVTransfer
server, a sender that can be killed mid-stream, and a whole worker (WorkerServer) to kill
while it streams. All run under multiprocessing 'spawn'.

The control pipe only starts work and reads pool statistics; KV itself always crosses
the gRPC socket.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import asdict

import torch

from pdserve.engine.sequence import SamplingParams

SPAWN = mp.get_context("spawn")


def _decode_main(conn, model_path: str | None, engine_kwargs: dict) -> None:
    from pdserve.engine.weights import load_model
    from pdserve.transfer.grpc_transport import serve_kv_transfer
    from tests.conftest import make_engine
    from tests.transfer.harness import decode_after_transfer, receiver_for

    torch.set_num_threads(1)
    engine = make_engine(load_model(model_path, progress=False), **engine_kwargs)
    receiver = receiver_for(engine)
    server, port = serve_kv_transfer(receiver)
    conn.send(port)
    while True:
        cmd, args = conn.recv()
        if cmd == "stop":
            server.stop(0)
            conn.send("stopped")
            return
        if cmd == "decode":
            request_id, prompt, first_token, rng_state, sampling = args
            rng = torch.tensor(rng_state, dtype=torch.uint8) if rng_state is not None else None
            conn.send(decode_after_transfer(engine, request_id, prompt, first_token, rng,
                                            SamplingParams(**sampling)))
        elif cmd == "generate":
            conn.send(engine.generate([args], SamplingParams(temperature=0, max_tokens=1),
                                      detokenize=False)[0].token_ids)
        elif cmd == "stats":
            conn.send({"free": engine.pool.num_free_blocks, "num_blocks": engine.pool.num_blocks,
                       "leaked": engine.leaked_blocks(), "parked": engine.num_parked(),
                       "outcomes": dict(receiver.outcomes)})


class DecodeProcess:
    """A decode engine in another process; KV arrives at `target` over gRPC."""

    def __init__(self, model_path: str | None, **engine_kwargs) -> None:
        self._conn, child = SPAWN.Pipe()
        self.process = SPAWN.Process(target=_decode_main, args=(child, model_path, engine_kwargs),
                                     daemon=True)
        self.process.start()
        if not self._conn.poll(180):
            raise TimeoutError("decode process did not start within 180 s")
        self.target = f"127.0.0.1:{self._conn.recv()}"

    def call(self, cmd: str, args=None, timeout: float = 120):
        self._conn.send((cmd, args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"decode process did not answer {cmd!r} within {timeout} s")
        return self._conn.recv()

    def decode(self, request_id, prompt, first_token, rng_state, sampling: SamplingParams):
        rng = rng_state.tolist() if rng_state is not None else None
        return self.call("decode", (request_id, prompt, first_token, rng, asdict(sampling)))

    def stats(self) -> dict:
        return self.call("stats")

    def wait_until_clean(self, timeout: float) -> tuple[float, dict]:
        """Seconds until no block is referenced and nothing is parked (or the last stats)."""
        start = time.monotonic()
        while True:
            stats = self.stats()
            if not stats["leaked"] and not stats["parked"]:
                return time.monotonic() - start, stats
            if time.monotonic() - start > timeout:
                return float("inf"), stats
            time.sleep(0.05)

    def close(self) -> None:
        try:
            self.call("stop", timeout=10)
        finally:
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()


def _stalling_sender_main(conn, model_path: str, target: str, prompt: list[int], timeout_s: float) -> None:
    """Push BEGIN and one LAYER frame of a real prefill, then stall forever (to be killed)."""
    from pdserve.engine.weights import load_model
    from pdserve.kvwire import TransferBegin, encode_layer
    from pdserve.transfer.grpc_transport import GrpcKVChannel
    from tests.conftest import make_engine
    from tests.transfer.harness import PrefillSide

    prefill = PrefillSide.of(make_engine(load_model(model_path, progress=False)))
    engine = prefill.engine
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), request_id="stall",
                       hold_blocks=True)
    engine.step()  # prefilled; its blocks are held for us
    layout = prefill.sender.layout
    n_blocks = -(-len(prompt) // layout.block_size)
    tb = TransferBegin("t-stall", "stall", layout, tuple(prompt), len(prompt), 0, tuple(range(n_blocks)))
    block_ids = engine._held["stall"]

    def frames():
        yield tb.encode(), b""
        yield from encode_layer(engine.kv_cache, 0, block_ids, list(range(n_blocks)), "t-stall")
        conn.send("streaming")
        while True:
            time.sleep(3600)

    GrpcKVChannel(target).push(frames(), timeout_s)


def start_stalling_sender(model_path: str, target: str, prompt: list[int], timeout_s: float):
    """Start the stalling sender; returns (process, connection) once it is mid-stream."""
    conn, child = SPAWN.Pipe()
    process = SPAWN.Process(target=_stalling_sender_main, args=(child, model_path, target, prompt, timeout_s),
                            daemon=True)
    process.start()
    if not conn.poll(180):
        process.kill()
        raise TimeoutError("stalling sender never started streaming")
    assert conn.recv() == "streaming"
    return process, conn


def _worker_main(conn, model_path: str, config_kwargs: dict) -> None:
    """A whole WorkerServer (Worker + KVTransfer over gRPC); answers its address, then waits."""
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.weights import load_model
    from pdserve.worker.server import WorkerConfig, WorkerServer

    torch.set_num_threads(1)
    engine = EngineConfig(cache=CacheConfig(num_blocks=128), device="cpu")
    worker = WorkerServer(WorkerConfig(engine=engine, metrics_port=None, **config_kwargs),
                          load_model(model_path, progress=False))
    conn.send((worker.config.worker_id, worker.start()))
    conn.recv()  # "stop"; or the test kills us
    worker.stop()


class WorkerProcess:
    """A worker in another process, to be SIGKILLed mid-transfer. config_kwargs go to WorkerConfig
    (a FaultPlan among them: it is plain frozen data, so it crosses the spawn boundary)."""

    def __init__(self, model_path: str, **config_kwargs) -> None:
        self._conn, child = SPAWN.Pipe()
        self.process = SPAWN.Process(target=_worker_main, args=(child, model_path, config_kwargs),
                                     daemon=True)
        self.process.start()
        if not self._conn.poll(180):
            self.process.kill()
            raise TimeoutError("worker process did not start within 180 s")
        self.worker_id, self.address = self._conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            self._conn.send("stop")
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
