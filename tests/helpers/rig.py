"""A prefill worker and a decode worker in this process (the Rig), for the KV transfer contract suite
and the tests of the decode worker's side of a hand-off.

Both are production `WorkerServer`s, called over real gRPC sockets (PrefillService.Prefill,
DecodeService.Decode): the prefill orchestration under test is the one production runs. Only the
channel that carries KV from P to D varies (CHANNELS):

    loopback  LoopbackKVChannel straight into D's receiver (no socket on the KV hop)
    grpc      GrpcKVChannel to D's KVTransfer service (the production default)
    faults    GrpcKVChannel inside a FaultInjectingChannel whose plan hits only the
              transfers a test names (every other transfer must pass through untouched)

A Gate holds a transfer still: the prefill worker's DELAY fault waits on it instead of
sleeping, after BEGIN and the chosen LAYER frame have been gathered, so a test can cancel,
expire, preempt or overwrite while the sender is behind, then let it go on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from decode_worker.role import DecodeConfig, DecodeRole
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.hashing import hash_blocks
from pdserve.engine.sequence import SamplingParams
from pdserve.engine.weights import LoadedModel
from pdserve.transfer.frames import KVFrames
from pdserve.worker.convert import sampling_to_proto
from pdserve.worker.server import WorkerConfig, WorkerServer
from prefill_worker.faults import FaultKind, FaultPlan, FaultRule, RequestIds
from prefill_worker.role import PrefillConfig, PrefillRole
from protos.pdserve.v1 import worker_pb2
from tests.conftest import make_engine
from tests.helpers.kv_audit import audit_failures
from tests.helpers.loopback import LoopbackKVChannel
from tests.helpers.workers import WorkerStubs

CHANNELS = ("loopback", "grpc", "faults")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
NEVER_HIT = FaultRule(FaultKind.CORRUPT, RequestIds({"no-such-request"}))


class Gate:
    """Stands in for the fault injector's sleep: blocks the transfer until open()."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self._open = threading.Event()

    def __call__(self, seconds: float) -> None:
        self.reached.set()
        self._open.wait(timeout=120)

    def open(self) -> None:
        self._open.set()


def hold(request_id: str, at_frame: int = 0) -> FaultRule:
    """Hold request_id's transfer on the Gate after its LAYER frame at_frame was gathered."""
    return FaultRule(FaultKind.DELAY, RequestIds({request_id}), at_frame=at_frame)


def engine_config(num_blocks: int = 128, budget: int = 2048, kv_dtype: str = "float32",
                  block_size: int = 16) -> EngineConfig:
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_dtype=kv_dtype)
    return EngineConfig(cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=budget), device="cpu")


@dataclass
class Rig:
    kind: str
    prefill: WorkerServer
    decode: WorkerServer
    gate: Gate
    _channels: list[grpc.Channel] = field(default_factory=list)

    def stub(self, worker: WorkerServer) -> WorkerStubs:
        channel = grpc.insecure_channel(worker.address)
        self._channels.append(channel)
        return WorkerStubs(channel)

    def prefill_request(self, request_id: str, prompt: list[int], sampling: SamplingParams = GREEDY,
                        decode_cached_blocks: int = 0) -> worker_pb2.PrefillRequest:
        return worker_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt,
                                         sampling=sampling_to_proto(sampling),
                                         decode_target=self.decode.address,
                                         decode_cached_blocks=decode_cached_blocks)

    def remote_prefill(self, request_id: str, prompt: list[int], sampling: SamplingParams = GREEDY,
                       decode_cached_blocks: int = 0, timeout: float = 60) -> worker_pb2.PrefillReply:
        """Worker.Prefill on P: grpc.RpcError when it fails."""
        request = self.prefill_request(request_id, prompt, sampling, decode_cached_blocks)
        return self.stub(self.prefill).Prefill(request, timeout=timeout)

    def decode_tokens(self, request_id: str, prompt: list[int], reply: worker_pb2.PrefillReply | None = None,
                      sampling: SamplingParams = GREEDY, worker: WorkerServer | None = None,
                      ) -> tuple[list[int], bool]:
        """Worker.Decode on D (or `worker`): resume the transferred KV when `reply` is given, else
        prefill there. Returns (tokens, whether the transferred KV was used)."""
        request = worker_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt,
                                           sampling=sampling_to_proto(sampling), prefill_here=reply is None)
        if reply is not None:
            request.first_token = reply.first_token
            if reply.HasField("first_logprob"):
                request.first_logprob.CopyFrom(reply.first_logprob)
        replies = list(self.stub(worker or self.decode).Decode(request, timeout=60))
        return [t for r in replies for t in r.token_ids], replies[0].used_transferred_kv

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        for worker in (self.prefill, self.decode):
            worker.stop()


def start_rig(loaded: LoadedModel, kind: str, *, rules: tuple[FaultRule, ...] = (),
              prefill_engine: EngineConfig | None = None, decode_engine: EngineConfig | None = None,
              max_chunk_bytes: int = 2 << 20, transfer_timeout_s: float | None = None,
              decode_loaded: LoadedModel | None = None, parked_ttl_s: float = 30.0,
              fault_sleep: Callable[[float], None] | None = None) -> Rig:
    """P and D started, P's KV channel of `kind`, P's fault plan of `rules` (the faults kind adds a
    rule that hits nothing, so its wrapper is always there). decode_loaded: another model for D;
    fault_sleep: what a DELAY waits with (default: the rig's Gate)."""
    if kind not in CHANNELS:
        raise ValueError(f"kind must be one of {CHANNELS}, got {kind!r}")
    gate = Gate()
    decode = WorkerServer(WorkerConfig("decode", decode_engine or engine_config(), metrics_port=None),
                          DecodeRole(DecodeConfig(parked_ttl_s=parked_ttl_s)), decode_loaded or loaded)
    decode.start()
    if kind == "faults":
        rules = (*rules, NEVER_HIT)
    plan = FaultPlan(rules) if rules else None
    dial: Callable | None = None
    if kind == "loopback":
        dial = lambda target: LoopbackKVChannel(decode.role.receiver)  # noqa: ARG005
    prefill_config = PrefillConfig(KVFrames(max_chunk_bytes), transfer_timeout_s, fault_plan=plan)
    role = PrefillRole(prefill_config, dial=dial, fault_sleep=fault_sleep or gate)
    config = WorkerConfig("prefill", prefill_engine or engine_config(), metrics_port=None)
    prefill = WorkerServer(config, role, loaded)
    prefill.start()
    return Rig(kind, prefill, decode, gate)


def reference_tokens(loaded: LoadedModel, prompt: list[int], sampling: SamplingParams = GREEDY) -> list[int]:
    """What one in-process engine generates: the answer every transfer path must give."""
    return make_engine(loaded).generate([prompt], sampling, detokenize=False)[0].token_ids


def cached_prompt_blocks(worker: WorkerServer, prompt: list[int]) -> int:
    """How many of the prompt's leading full blocks the worker's prefix cache holds."""
    engine = worker.engine
    with engine.lock:
        return len(engine.pool.match_prefix(hash_blocks(prompt, engine.block_size, engine.salt)))


def assert_no_wrong_kv(*workers: WorkerServer) -> None:
    """The KV audit of every worker: each block it caches is its prompt's true KV (tests/helpers/kv_audit.py).
    Every fault test ends with it."""
    failures = audit_failures([w.address for w in workers])
    assert not failures, failures
