"""The KV audit: recompute cached blocks from their token prefix and compare with the stored bytes.

A checksum proves KV bytes arrived as sent; this proves they are right. The pool keeps, per
hashed block, its token ids and its parent's hash, so a cached block's whole token prefix is
known (BlockPool.prefix_chain). One audit (KVAuditor.audit):

    PLAN       under engine.lock: targets = a random sample of hashed blocks (or all of them),
               in use or not; each target's chain = the blocks of its prefix, root first. A
               target already on a longer planned chain rides on that chain's recompute. A
               target with no chain (an ancestor was evicted) is SKIPPED: it can never be
               matched (matching walks from the first block) and LRU eviction reclaims it.
    SNAPSHOT   under engine.lock, per chain: every block must still hold its planned hash (else
               the chain's unchecked blocks are skipped); copy their stored bytes.
    RECOMPUTE  without the lock, chains in hash order: the chain's tokens through the engine's
               own ModelRunner and model, over a scratch KV tensor sized for the chain. A chain
               that shares its first k blocks with the previous chain copies their recomputed KV
               and computes the rest as one chunk from position k x block_size (the prefix-hit
               path); otherwise one chunk from position 0. So a full audit costs about one
               prefill of the distinct cached tokens, not one per leaf of a shared system prompt.
               No pool block is taken, no request or event is created.
    COMPARE    each block's stored rows with the recomputed ones (ComparisonRule).
    EVICT      under engine.lock, a mismatched block that still holds its hash:
               LLMEngine.discard_block -> BlockPool.discard records BlockRemoved, which the
               engine's publisher ships (the index unpublishes it). A block in use loses its
               hash at once (nothing new matches it) and is freed when its holders release it;
               the requests holding it run on.

Why a tolerance. The recompute is a prefill of exactly the chain's tokens, but the block was
computed inside a prompt of another length, in prefill chunks, batched with other sequences,
by decode steps, or after a prefix hit; a CPU GEMM's rows can differ in the last bits with the
batch shape. So the recompute is bit-exact where it repeats the original computation (a prompt
of whole blocks prefilled alone in one chunk: tests/engine/test_audit.py pins it) and only
close elsewhere. Measured on CPU (float32 compute), KVAuditor over every cached block, worst
difference relative to the largest |value| of the block's (layer, K|V) slab:

    path (SmolLM2-135M)                       bit-exact  float32  float16  bfloat16
    prompts one by one, one chunk each          10/13    1.9e-6   9.8e-4   6.4e-3
    chunked prefill (23-token budget)            3/10    3.4e-6   9.4e-4   6.9e-3
    6 prompts batched in one step                6/19    3.1e-6   1.2e-3   7.5e-3
    chunks + decode steps, decode-filled blocks  0/25    3.3e-6   2.5e-3   1.6e-2
    after a prefix-cache hit                     0/11    3.3e-6   1.4e-3   7.5e-3
    preempted and recomputed (14-block pool)     2/12    5.3e-6   9.4e-4   7.5e-3
    1,000-token prompts, 256 chunks, 100 decode 63/197   7.2e-6   1.5e-3   1.6e-2
    1,000-token shared system prompt, 10 tails  47/97    4.8e-6   1.2e-3   1.0e-2
    received from another worker over gRPC      the sender's bytes, verbatim: as the sender's path

(bit-exact counts are the float32 runs. The tiny test model is bit-exact on every path but
chunked, decode-filled and preempted blocks, worst 4.7e-7 / 5.9e-4 / 1.0e-3.) A float16 or
bfloat16 cache rounds each value once; a last-bit difference before rounding can flip it, so
there the differences are a few units in the last place of the cache type.

An int8 or fp8 cache is compared as the model reads it (codes times their row's scale, plus
int8's offset). A last-bit difference can move a code by a whole step (int8: 1/255 of its rotated
row's range; about 1/14 at e4m3's top for fp8), and that moved value changes every layer above it,
so the differences grow with depth (int8, chunks + decode steps: 0 at layer 0, one step up to layer
12, 0.07 at layer 20). Measured as above on int8's first format (absmax, 1/127 of the row's largest
value), SmolLM2-135M (the 1,000-token rows with prompts of our own):

    path (SmolLM2-135M)                          int8     fp8
    prompts one by one, one chunk each           0        0        (13/13 bit-exact)
    chunked prefill (23-token budget)            2.6e-2   1.1e-1
    6 prompts batched in one step                0        0        (19/19 bit-exact)
    chunks + decode steps, decode-filled blocks  7.1e-2   1.8e-1
    after a prefix-cache hit                     0        0        (11/11 bit-exact)
    preempted and recomputed (14-block pool)     2.3e-2   9.2e-2
    1,000-token prompts, 256 chunks, 100 decode  5.8e-2   1.7e-1
    1,000-token shared system prompt, 10 tails   4.1e-2   1.3e-1

(the tiny model: bit-exact or within 5e-7 on every path, for both.) Hence the rule: a block
passes when its bytes are identical (counted as exact), or when in every (layer, K|V) slab

    max |stored - recomputed|  <=  tolerance(dtype) x max |recomputed|

with tolerance 2^-14 (6.1e-5) for float32, 8 x 2^-10 (7.8e-3) for float16, 8 x 2^-7
(6.3e-2) for bfloat16, 32/127 (0.25, 32 int8 steps) for int8 and 7 x 32/448 (0.5, 7 steps of
e4m3's top binade) for fp8: 8.5x, 3.1x, 3.9x, 3.6x and 2.9x the worst difference measured. So an
int8/fp8 audit catches a wrong prefix, a misplaced block or a corrupt scale, not a code one step
off. A stored NaN or inf never passes. Every report gives its worst difference, so the margin
can be watched in service. A GPU has not been measured; the rule is the same there.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass

import torch

from pdserve.engine.block_pool import Discarded
from pdserve.engine.hashing import BlockHash
from pdserve.engine.kv_format import KV_FORMATS
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner, allocate_kv_cache
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.sequence import SamplingParams, Sequence

log = logging.getLogger(__name__)

# Relative to the largest |value| of a block's (layer, K|V) slab; see the module docstring.
TOLERANCE = {"float32": 2.0**-14, "float16": 8 * 2.0**-10, "bfloat16": 8 * 2.0**-7,
             "int8": 32 / 127, "fp8": 7 * 32 / 448}


@dataclass(frozen=True)
class BlockVerdict:
    exact: bool
    passed: bool
    max_abs_diff: float
    max_rel_diff: float


@dataclass(frozen=True)
class ComparisonRule:
    kv_dtype: str
    tolerance: float

    @classmethod
    def for_dtype(cls, kv_dtype: str, model_dtype: str = "float32") -> ComparisonRule:
        """NOTE: a recompute at another batch shape moves K/V by a rounding step of the model's dtype
        too, so a bfloat16 model's float32 rows get bfloat16's tolerance."""
        return cls(kv_dtype, max(TOLERANCE[kv_dtype], TOLERANCE[model_dtype]))

    def describe(self) -> str:
        return (f"bit-exact, else max|stored - recomputed| <= {self.tolerance:.3g} x max|recomputed| "
                f"in every (layer, K|V) slab of the block ({self.kv_dtype} cache)")

    def compare(self, stored: torch.Tensor, recomputed: torch.Tensor) -> BlockVerdict:
        """stored, recomputed: one block as the pool holds it, [layers, 2, block_size, kv_heads, row];
        values compared as the model reads them (int8/fp8: codes times their scales)."""
        fmt = KV_FORMATS[self.kv_dtype]
        s, r = fmt.load(stored), fmt.load(recomputed)
        if not bool(torch.isfinite(s).all()):
            return BlockVerdict(False, False, float("inf"), float("inf"))  # a stored NaN or inf never passes
        if torch.equal(stored.view(torch.uint8), recomputed.view(torch.uint8)):
            return BlockVerdict(True, True, 0.0, 0.0)
        diff = (s - r).abs().amax(dim=(2, 3, 4))  # [layers, 2]
        scale = r.abs().amax(dim=(2, 3, 4))
        passed = bool((diff <= self.tolerance * scale).all())
        rel = diff / scale.clamp_min(torch.finfo(torch.float32).tiny)
        return BlockVerdict(False, passed, float(diff.max()), float(rel.max()))


@dataclass
class AuditReport:
    """One audit. mismatched - evicted = mismatched blocks the engine had evicted meanwhile."""

    rule: str
    cached_blocks: int = 0  # hashed blocks when the audit planned
    checked: int = 0
    exact: int = 0  # of checked: identical bytes
    mismatched: int = 0
    evicted: int = 0  # mismatched blocks taken out of the prefix cache and unpublished
    evicted_in_use: int = 0  # of evicted: still referenced, freed when their holders release them
    skipped: int = 0  # no chain (an ancestor evicted), or evicted between planning and the check
    recomputed_tokens: int = 0  # what the audit cost: tokens run through the model
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0
    elapsed_s: float = 0.0
    complete: bool = True  # False: stop_at came before every chain was checked

    def add(self, verdict: BlockVerdict) -> None:
        self.checked += 1
        self.exact += verdict.exact
        self.max_abs_diff = max(self.max_abs_diff, verdict.max_abs_diff)
        self.max_rel_diff = max(self.max_rel_diff, verdict.max_rel_diff)


@dataclass
class AuditTotals:
    """Since the auditor was made (Status and /metrics read these)."""

    audits: int = 0
    checked: int = 0
    mismatched: int = 0
    evicted: int = 0
    seconds: float = 0.0


@dataclass
class _Chain:
    """One recompute: the chain's blocks and hashes, root first, and which of them to check."""

    block_ids: list[int]
    hashes: list[BlockHash]
    tokens: list[int]
    check: list[int]  # positions in the chain: blocks no earlier chain checks


@dataclass(frozen=True)
class _Recomputed:
    """The last chain's recomputed KV, kept for the next chain that shares its leading blocks."""

    hashes: list[BlockHash]
    kv: torch.Tensor


class KVAuditor:
    """Audits one engine's prefix cache; one audit at a time (the RPC and the scrubber share it)."""

    def __init__(self, engine: LLMEngine, rng: random.Random | None = None) -> None:
        self.engine = engine
        self.rule = ComparisonRule.for_dtype(engine.config.cache.kv_dtype, engine.config.dtype)
        self._rng = rng or random.Random()
        self._busy = threading.Lock()
        self._totals_lock = threading.Lock()
        self._totals = AuditTotals()

    def totals(self) -> AuditTotals:
        with self._totals_lock:
            return AuditTotals(**vars(self._totals))

    def audit(self, sample: int = 0, stop_at: float | None = None) -> AuditReport:
        """Check `sample` randomly chosen cached blocks (0: every one), each with its cached
        ancestors, which the same recompute covers; stop starting chains at stop_at (monotonic)."""
        if sample < 0:
            raise ValueError(f"sample must be >= 0 (0 = every cached block), got {sample}")
        with self._busy:
            started = time.perf_counter()
            report = AuditReport(self.rule.describe())
            previous: _Recomputed | None = None
            # NOTE: in hash order, chains that share leading blocks are neighbours (as sorted strings
            # are), so each one shares the most it can with the one recomputed just before it.
            for chain in sorted(self._plan(sample, report), key=lambda c: c.hashes):
                if stop_at is not None and time.monotonic() >= stop_at:
                    report.complete = False
                    break
                previous = self._check(chain, report, previous) or previous
            report.elapsed_s = time.perf_counter() - started
            self._count(report)
            return report

    def _count(self, report: AuditReport) -> None:
        with self._totals_lock:
            t = self._totals
            t.audits += 1
            t.checked += report.checked
            t.mismatched += report.mismatched
            t.evicted += report.evicted
            t.seconds += report.elapsed_s

    # --- PLAN ----------------------------------------------------------------------------------
    def _plan(self, sample: int, report: AuditReport) -> list[_Chain]:
        engine, pool = self.engine, self.engine.pool
        with engine.lock:
            hashed = pool.cached_block_ids()
            report.cached_blocks = len(hashed)
            targets = self._rng.sample(hashed, sample) if 0 < sample < len(hashed) else hashed
            found = [(t, pool.prefix_chain(t)) for t in targets]
            report.skipped += sum(chain is None for _, chain in found)
            found = [(t, chain) for t, chain in found if chain is not None]
            found.sort(key=lambda tc: len(tc[1]), reverse=True)  # longest first: ancestors ride on them
            chains: list[_Chain] = []
            covered: set[int] = set()
            for target, ids in found:
                if target in covered:  # on a longer chain already: checked by its recompute
                    continue
                tokens = [t for b in ids for t in pool.block_tokens(b)]
                check = [i for i, b in enumerate(ids) if b not in covered]
                chains.append(_Chain(ids, [pool.block_hash(b) for b in ids], tokens, check))
                covered.update(ids)
        return chains

    # --- SNAPSHOT, RECOMPUTE, COMPARE, EVICT -------------------------------------------------------
    def _check(self, chain: _Chain, report: AuditReport, previous: _Recomputed | None) -> _Recomputed | None:
        engine = self.engine
        with engine.lock:
            pool = engine.pool
            if any(pool.block_hash(b) != h for b, h in zip(chain.block_ids, chain.hashes, strict=True)):
                report.skipped += len(chain.check)  # evicted (maybe reused) since the plan
                return None
            ids = [chain.block_ids[i] for i in chain.check]
            stored = engine.kv_cache[:, :, ids].clone()  # [layers, 2, n, block_size, heads, dim]
        shared = _leading_blocks_shared(chain, previous)
        recomputed = self.recompute(chain.tokens, (previous.kv, shared) if previous and shared else None)
        report.recomputed_tokens += len(chain.tokens) - shared * engine.block_size
        for n, pos in enumerate(chain.check):
            verdict = self.rule.compare(stored[:, :, n], recomputed[:, :, pos])
            report.add(verdict)
            if not verdict.passed:
                self._evict(chain.block_ids[pos], chain.hashes[pos], verdict, report)
        return _Recomputed(chain.hashes, recomputed)

    def recompute(self, tokens: list[int], reuse: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
        """KV of tokens (whole blocks) computed by the engine's own model code path on a scratch
        tensor: [layers, 2, len(tokens) // block_size, block_size, heads, dim]. reuse=(kv, k): the
        first k blocks are already recomputed in kv; the rest is one chunk on top of them, as a
        prefix-cache hit computes it. Else one chunk from position 0."""
        engine, block_size = self.engine, self.engine.block_size
        num_blocks = len(tokens) // block_size
        scratch = allocate_kv_cache(engine.model, num_blocks, block_size, engine.config.cache.kv_dtype)
        start = 0
        if reuse is not None:
            kv, start_block = reuse
            scratch[:, :, :start_block] = kv[:, :, :start_block]
            start = start_block * block_size
        seq = Sequence("kv-audit", list(tokens), SamplingParams(max_tokens=1), arrival=0)
        seq.block_ids = list(range(num_blocks))
        ModelRunner(engine.model, scratch, block_size).run([ScheduledChunk(seq, start, len(tokens) - start)])
        return scratch

    def _evict(self, block_id: int, block_hash: BlockHash, verdict: BlockVerdict,
               report: AuditReport) -> None:
        report.mismatched += 1
        outcome = self.engine.discard_block(block_id, block_hash)
        if outcome is not Discarded.GONE:
            report.evicted += 1
            report.evicted_in_use += outcome is Discarded.UNLISTED
        log.warning("KV audit: block %d (hash %s) differs from its recompute by %.3g (%.3g of the slab's "
                    "largest value; the rule: %s): %s", block_id, block_hash.hex(), verdict.max_abs_diff,
                    verdict.max_rel_diff, self.rule.describe(), outcome.value)


def _leading_blocks_shared(chain: _Chain, previous: _Recomputed | None) -> int:
    """How many leading blocks chain can take from the previous recompute; its last block is
    always computed here (the chunk must end at the chain's last token)."""
    if previous is None:
        return 0
    shared = 0
    for mine, theirs in zip(chain.hashes[:-1], previous.hashes):
        if mine != theirs:
            break
        shared += 1
    return shared
