"""One simulated worker: the engine's own BlockPool, Scheduler and KVHandoff, timed by the cost model.

The simulator does not copy the engine's policy: it drives pdserve/engine/scheduler.py (chunked
prefill under a token budget, FCFS admission, preemption of the newest by recompute, LRU prefix
cache in block_pool.py) and pdserve/engine/handoff.py (reserve -> park -> claim of transferred KV)
exactly as LLMEngine does, and replaces the model's run by a duration from sim/costs.py.

Lifecycle of one step (the cluster calls these):

    start_step(now) -> duration or None (nothing to run)   the scheduler picks the chunks
    finish_step()   -> [Emitted]                            after_step; sampled chunks get a token

With trace=True a worker keeps every step it ran as a SimStep (what it computed, when it started,
how long it took), as a real worker's step trace does (Worker.Steps): bench.sim_validate compares
the two.

A prefill worker's sequences ask for one token (the first token, which goes to the decode worker
with the KV); a decode worker's ask for their max_tokens. Generated tokens are the request's own
`reply` ids, so a multi-turn conversation's next prompt (which carries the reply) hits the cache
as it does on the real cluster.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import random
from dataclasses import dataclass

from pdserve.engine.block_pool import BlockPool, NoFreeBlocksError
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.handoff import KVHandoff, Reservation, TransferRejected
from pdserve.engine.hashing import hash_blocks
from pdserve.engine.scheduler import ScheduledChunk, Scheduler, StepShape
from pdserve.engine.sequence import SamplingParams, Sequence, SequenceStatus
from pdserve.engine.validation import EngineLimits
from sim.costs import CostModel

SALT = b"pdserve-sim"
VOCAB = 1 << 20  # simulated token ids are plain ints below this


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"  # also prefills what the router leaves on it (and all of it when colocated)


@dataclass(frozen=True, slots=True)
class SimStep:
    """One step a simulated worker ran: what it computed, its start and its duration (stretches included)."""

    worker_id: str
    start_s: float
    shape: StepShape
    seconds: float


@dataclass(frozen=True)
class Emitted:
    """A token a step produced for request_id; finished: the sequence ended with it."""

    request_id: str
    finished: bool
    cached_tokens: int  # the sequence's prefix-cache hit at admission


class SimWorker:
    def __init__(self, worker_id: str, role: Role, costs: CostModel, seed: int = 0,
                 trace: bool = False) -> None:
        hw = costs.hardware
        self.worker_id, self.role, self.costs = worker_id, role, costs
        self._spread = random.Random(f"{seed}/steps/{worker_id}")  # draws each step's spread factor
        self.pool = BlockPool(hw.num_blocks, hw.block_size)
        batching = SchedulerConfig(hw.max_num_batched_tokens, hw.max_num_seqs)
        self.scheduler = Scheduler(batching, self.pool, SALT)
        self.limits = EngineLimits(VOCAB, 1 << 30)
        self.handoff = KVHandoff(self.pool, SALT, self.limits, contextlib.nullcontext(), (),
                                 self.pool.drain_events)
        self.replies: dict[str, tuple[int, ...]] = {}
        self.busy = False
        self.steps = 0
        self.step_seconds = 0.0  # the sum of its steps' durations
        self.step_start = 0.0  # when the step in flight started
        self.step_end = 0.0  # when the step in flight ends (the cluster moves it: stretch())
        self.trace: list[SimStep] | None = [] if trace else None  # every step run, with trace=True
        self._shape = StepShape()
        self.preemptions = 0
        self._chunks: list[ScheduledChunk] = []
        self._arrival = itertools.count()

    # --- requests in ----------------------------------------------------------------------------
    def add(self, request_id: str, prompt: tuple[int, ...], reply: tuple[int, ...]) -> None:
        """Queue a prompt to prefill here (and decode, on a decode worker)."""
        max_tokens = 1 if self.role is Role.PREFILL else len(reply)
        self.replies[request_id] = reply
        seq = Sequence(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       next(self._arrival))
        self.scheduler.add(seq)

    def cached_blocks(self, hashes: list) -> int:
        """Leading blocks of a prompt this worker's prefix cache holds (what the index would say)."""
        return len(self.pool.match_prefix(hashes))

    def reserve(self, request_id: str, prompt: tuple[int, ...], cached_blocks: int) -> Reservation | None:
        """Hold blocks for an incoming transfer; None when the pool cannot (the router prefills here)."""
        try:
            return self.handoff.reserve(request_id, list(prompt), cached_blocks)
        except (NoFreeBlocksError, TransferRejected):
            return None

    def resume(self, reservation: Reservation, reply: tuple[int, ...]) -> Emitted:
        """The KV arrived: park it, claim it and join the batch with the first token, as
        LLMEngine.resume_transferred does."""
        self.handoff.park(reservation)
        rid, prompt = reservation.request_id, reservation.prompt_token_ids
        sampling = SamplingParams(max_tokens=len(reply), ignore_eos=True)
        claimed = self.handoff.claim(rid, prompt, reply[0], sampling, b"")
        assert claimed is not None
        seq = Sequence(rid, prompt, sampling, next(self._arrival))
        seq.block_ids = list(claimed.block_ids)
        seq.num_computed_tokens = seq.num_tokens
        seq.num_committed_blocks = seq.num_tokens // self.pool.block_size
        seq.admitted_once = True
        seq.usage.cached_tokens = claimed.num_cached_blocks * self.pool.block_size
        self.replies[rid] = reply
        self.scheduler.add_running(seq)
        return self._append(seq)

    # --- steps ----------------------------------------------------------------------------------
    def start_step(self, now: float) -> float | None:
        out = self.scheduler.schedule()
        self.preemptions += len(out.preempted)
        if not out.chunks:
            return None
        self._chunks, self.busy = out.chunks, True
        self._shape = StepShape.of(out.chunks)  # what LLMEngine.last_step would say of the same chunks
        self.steps += 1
        duration = self.step_duration(self._shape)
        self.step_seconds += duration
        self.step_start, self.step_end = now, now + duration
        return duration

    def step_duration(self, shape: StepShape) -> float:
        formula = self.costs.step_s(list(shape.prefill), shape.decode_seqs, shape.decode_context)
        return formula * self.costs.step.spread_factor(self._spread.random())

    def stretch(self, seconds: float) -> None:
        """The step in flight takes `seconds` longer (another worker's step shares the machine)."""
        self.step_end += seconds
        self.step_seconds += seconds

    def finish_step(self) -> list[Emitted]:
        if self.trace is not None:
            self.trace.append(SimStep(self.worker_id, self.step_start, self._shape,
                                      self.step_end - self.step_start))
        chunks, self._chunks, self.busy = self._chunks, [], False
        self.scheduler.after_step(chunks)
        return [self._append(c.seq) for c in chunks if c.samples]

    def _append(self, seq: Sequence) -> Emitted:
        reply = self.replies[seq.request_id]
        seq.token_ids.append(reply[min(seq.usage.completion_tokens, len(reply) - 1)])
        seq.usage.completion_tokens += 1
        done = seq.usage.completion_tokens >= seq.sampling.max_tokens
        if done:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
            del self.replies[seq.request_id]
        return Emitted(seq.request_id, done, seq.usage.cached_tokens)

    # --- what the router sees -------------------------------------------------------------------
    @property
    def used_block_fraction(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def leaked_blocks(self) -> list[int]:
        return self.pool.leaked_blocks()


def prompt_hashes(prompt: tuple[int, ...], block_size: int) -> list:
    return hash_blocks(list(prompt), block_size, SALT)
