"""Continuous batching with chunked prefill, FCFS, preemption by recompute.

Each step spends a token budget (max_num_batched_tokens):

  1. RUNNING sequences, oldest first: one token each when decoding, the next
     prefill chunk when still prefilling. A sequence that needs a block the
     pool cannot give preempts the *newest* running sequence (its blocks are
     released; full ones stay cached) and, if it is itself the newest, waits.
  2. WAITING sequences, strictly first-come-first-served, while budget, blocks
     and max_num_seqs allow, and only if nobody was preempted this step. On
     admission a sequence takes the longest cached prefix of whole blocks (device
     blocks, then blocks a lower tier holds, loaded back: BlockPool.acquire_prefix),
     capped so that at least its last token is computed (its logits are
     needed to sample).

After the model has run, after_step() advances num_computed_tokens and commits
the hashes of blocks that became full, so later requests can share them.

on_preempt(seq), when given to schedule(), runs right after a victim's blocks are released
and before the pool is looked at again: a KV sender still holding references on the
victim's blocks lets go of them there, so the preemption really frees memory.

The scheduler owns its queues: only its own methods change `waiting` and `running` (add,
add_running for a sequence whose KV is already in place, finish, schedule). Others may read
them; LLMEngine.load reads num_running / num_waiting without the engine's lock (one len()
each, atomic under the GIL).
Pure logic: the block pool and sequences only, no torch and no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.events import Tier
from pdserve.engine.hashing import request_salt
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.units import ceil_div


@dataclass(frozen=True)
class ScheduledChunk:
    """num_tokens tokens of seq, from position start, computed in this step."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the sequence's last token: its logits are sampled."""
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(frozen=True)
class StepShape:
    """What one step computed, in the terms of the simulator's cost model (sim/costs.py): each
    prefill chunk as (new tokens, tokens before them), and the decoding sequences with their total
    context (tokens each attends to, its new one included)."""

    prefill: tuple[tuple[int, int], ...] = ()
    decode_seqs: int = 0
    decode_context: int = 0

    @classmethod
    def of(cls, chunks: list[ScheduledChunk]) -> StepShape:
        """A chunk of one token past its prompt is a decode row; any other chunk is prefill
        (a prompt's chunk, or a preempted sequence's recompute)."""
        def decodes(c: ScheduledChunk) -> bool:
            return c.num_tokens == 1 and c.start >= c.seq.num_prompt_tokens

        decode = [c.end for c in chunks if decodes(c)]
        return cls(tuple((c.num_tokens, c.start) for c in chunks if not decodes(c)), len(decode), sum(decode))


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, salt: bytes,
                 enable_prefix_caching: bool = True) -> None:
        self.config = config
        self.pool = pool
        self.salt = salt
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # --- queue management -----------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose KV is already in its blocks (a transferred prompt) to the batch."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take seq out of the queues and release its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = status

    # --- one step ---------------------------------------------------------
    def schedule(self, on_preempt: Callable[[Sequence], None] | None = None) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens, on_preempt)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def after_step(self, chunks: list[ScheduledChunk]) -> None:
        for chunk in chunks:
            chunk.seq.num_computed_tokens = chunk.end
            self._commit_full_blocks(chunk.seq)

    # --- internals ----------------------------------------------------------
    def _schedule_running(self, out: SchedulerOutput, budget: int,
                          on_preempt: Callable[[Sequence], None] | None) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, seq.num_computed_tokens + n, out, on_preempt):
                break  # seq itself was the newest and got preempted
            self._grow(seq, seq.num_computed_tokens + n)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
            i += 1
        return budget

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput,
                   on_preempt: Callable[[Sequence], None] | None) -> bool:
        """Preempt newest-first until seq's blocks for num_tokens fit; False if seq went."""
        while self._blocks_needed(seq, num_tokens) > self.pool.num_free_blocks:
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if on_preempt is not None:
                on_preempt(victim)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            matched, restored = self._take_cached_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self._blocks_needed(seq, seq.num_computed_tokens + n) > self.pool.num_free_blocks:
                self._release(seq)  # give the prefix hit back; FCFS: nobody jumps the queue
                break
            self.waiting.popleft()
            self._grow(seq, seq.num_computed_tokens + n)
            self._record_admission(seq, matched, restored)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n

    def _take_cached_prefix(self, seq: Sequence) -> tuple[int, dict[Tier, int]]:
        """Acquire seq's longest cached prefix, loading back what a lower tier holds; returns the
        number of tokens it covers and the blocks restored per tier."""
        if not self.enable_prefix_caching:
            return 0, {}
        max_blocks = (seq.num_tokens - 1) // self.block_size  # the last token is always computed
        salt = request_salt(self.salt, seq.cache_salt)
        hashes = seq.full_block_hashes(self.block_size, salt)[:max_blocks]
        hit = self.pool.acquire_prefix(hashes)
        seq.block_ids = list(hit.block_ids)
        seq.num_committed_blocks = len(hit.block_ids)
        seq.num_computed_tokens = len(hit.block_ids) * self.block_size
        return seq.num_computed_tokens, hit.restored

    def _record_admission(self, seq: Sequence, cached_tokens: int, restored: dict[Tier, int]) -> None:
        if seq.admitted_once:
            return
        seq.admitted_once = True
        seq.usage.cached_tokens = cached_tokens
        seq.usage.host_cached_tokens = restored.get(Tier.HOST, 0) * self.block_size
        seq.usage.disk_cached_tokens = restored.get(Tier.DISK, 0) * self.block_size
        seq.usage.computed_tokens = seq.num_tokens - cached_tokens  # a continued one replays its output too

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, ceil_div(num_tokens, self.block_size) - len(seq.block_ids))

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self._blocks_needed(seq, num_tokens)
        if need:
            seq.block_ids.extend(self.pool.allocate(need))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.usage.preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.pool.release(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0

    def _commit_full_blocks(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_committed_blocks:
            return
        hashes = seq.full_block_hashes(self.block_size, request_salt(self.salt, seq.cache_salt))
        self.pool.commit_blocks(seq.block_ids, hashes[:full], seq.token_ids, start=seq.num_committed_blocks)
        seq.num_committed_blocks = full
