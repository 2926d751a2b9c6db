"""KV-aware placement: a cost for every way to serve a prompt, the cheapest wins.

Pure: no I/O. The caller supplies, per worker, how many leading blocks of the prompt
it holds (from the prefix index) and its load; the random source breaks ties.

For a prompt of T tokens in blocks of B (n = ceil(T / B) blocks) and a decode worker D
holding d_D leading blocks (usable: at most (T - 1) // B, the last token is always
computed), the options are:

    local on D      cost = w_local_prefill * (T - B * d_D)            tokens D must prefill
                         + w_decode_load  * load(D)
    P then D        cost = w_prefill      * (T - B * d_P)             tokens P must prefill
                         + w_transfer     * (n - d_D)                 blocks sent to D
                         + w_prefill_load * load(P) + w_decode_load * load(D)

A worker's d leading blocks may sit partly in a tier below its device pool (host memory, disk):
they are loaded back instead of recomputed, so each such block costs B x its tier's reload
weight (reload time / recompute time, measured by bench.kv_tiers, not guessed) of the prefill
cost instead of nothing:

    lacking(D)  = T - B * d_D + B * (host_reload * host_D + disk_reload * disk_D)

where host_D, disk_D count the blocks of d_D held in each lower tier (held_by_tier below).

load(D) = active sequences + w_blocks_used * fraction of D's KV blocks in use.
w_local_prefill > w_prefill because prefill on a decode worker stalls its decode
streams, which is why disaggregation exists. Before any cost: when the part of the
prompt D lacks is shorter than local_prefill_max_tokens (the next turn of a chat, a
shared system prompt) the request stays on D with no transfer at all.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, fields, replace

from pdserve.engine.events import Tier, index_key
from pdserve.engine.hashing import BlockHash
from pdserve.units import ceil_div

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScoringWeights:
    prefill: float = 1.0  # per token prefilled on a prefill worker
    local_prefill: float = 2.0  # per token prefilled on the decode worker
    transfer: float = 4.0  # per block sent (a block is worth ~a few tokens of compute)
    decode_load: float = 64.0  # per active sequence on the decode worker
    prefill_load: float = 256.0  # per request in flight on the prefill worker
    blocks_used: float = 32.0  # load added by a full KV pool (fraction x this)
    local_prefill_max_tokens: int = 256  # below this, the uncached part is prefilled on D
    # A lower tier's block costs this fraction of recomputing it: reload / recompute as measured by
    # `python -m bench.kv_tiers` on a 2-core CPU machine (its `host_reload_weight`,
    # `disk_reload_weight`; docs/benchmarks.md, the KV tier rows). NOTE: disk measured below host
    # there, which is the load's noise, not the hardware: disk is kept at host's until a quieter run
    # separates them. Rerun the bench on other hardware (a GPU worker reloads over PCIe) and set
    # these from it.
    host_reload: float = 0.09
    disk_reload: float = 0.09

    def overridden(self, overrides: Mapping[str, float]) -> ScoringWeights:
        """A copy with per-request overrides; ValueError names an unknown or out-of-range weight."""
        if not overrides:  # the common request: no copy (the weights are frozen)
            return self
        known = {f.name: f.type for f in fields(self)}
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise ValueError(f"unknown routing weight(s) {', '.join(unknown)}; known: {', '.join(known)}")
        # NOTE: a NaN weight makes every cost NaN (no cheapest option), a negative one rewards load.
        bad = next(((k, v) for k, v in sorted(overrides.items()) if not (math.isfinite(v) and v >= 0)), None)
        if bad is not None:
            raise ValueError(f"routing weight {bad[0]} must be a finite number >= 0, got {bad[1]}")
        cast = {k: int(v) if k == "local_prefill_max_tokens" else float(v) for k, v in overrides.items()}
        return replace(self, **cast)


@dataclass(frozen=True)
class Candidate:
    """A live worker a request may be placed on, with its load as the router sees it. The one type
    of both placements: by load (router/least_load.py) and by cost here."""

    worker_id: str
    address: str
    active_requests: int  # sequences on it, from every router (router/shared_load.py estimated_load)
    used_block_fraction: float = 0.0  # of its KV blocks, as its heartbeat reported


@dataclass(frozen=True)
class Choice:
    decode: Candidate
    prefill: Candidate | None  # None: prefill on the decode worker
    cost: float
    decode_cached_blocks: int  # blocks D holds: not sent, not recomputed by D
    prefill_cached_blocks: int


@dataclass(frozen=True)
class LowerHeld:
    """Of a worker's leading run of held blocks, how many sit in its host and disk tiers (the run's
    last ones: the device run comes first, then the host run, then the disk run)."""

    host: int = 0
    disk: int = 0


def held_by_tier(match: Callable[[Sequence[BlockHash]], Mapping[str, int]], hashes: Sequence[BlockHash],
                 tiered: Collection[str]) -> tuple[dict[str, int], dict[str, LowerHeld]]:
    """Each worker's leading run over every tier, and the part of it in lower tiers.

    The index keys a lower tier's block by events.index_key, so: match the device keys, then, after
    the device run of each worker in `tiered` (those whose registry entry lists a host tier), the
    host keys, then the disk keys. A cluster without lower tiers pays the one device match.
    NOTE: a run that goes back up a tier (a device block after a host one) is cut there; that
    counts fewer blocks, never a block a worker lacks (it recomputes what it does not hold anyway).
    """
    held = {w: n for w, n in match(hashes).items() if n}
    lower: dict[str, LowerHeld] = {}
    for tier in (Tier.HOST, Tier.DISK):
        starts = sorted({held.get(w, 0) for w in tiered if held.get(w, 0) < len(hashes)})
        if not starts:
            continue
        derived: dict[int, BlockHash] = {}  # one tier key per block, shared by every start
        for start in starts:
            for worker, n in match(_TierKeys(hashes, tier, start, derived)).items():
                if n and worker in tiered and held.get(worker, 0) == start:
                    held[worker] = start + n
                    was = lower.get(worker, LowerHeld())
                    lower[worker] = replace(was, **{tier.value: getattr(was, tier.value) + n})
    return held, lower


class _TierKeys(Sequence[BlockHash]):
    """index_key(hashes[i], tier) for i from start on, each derived (and hashes[i] read) only when a
    match reads it: a match stops at the first block no worker holds, and hashes may be a lazy
    hashing.PromptHashes. derived: block index -> its key, shared with other starts of one tier."""

    def __init__(self, hashes: Sequence[BlockHash], tier: Tier, start: int,
                 derived: dict[int, BlockHash]) -> None:
        self._hashes, self._tier, self._start, self._derived = hashes, tier, start, derived

    def __len__(self) -> int:
        return len(self._hashes) - self._start

    def __getitem__(self, i):  # type: ignore[override]  # int or slice, as a list's
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"key {i} of {len(self)}")
        block = self._start + i
        key = self._derived.get(block)
        if key is None:
            key = self._derived[block] = index_key(self._hashes[block], self._tier)
        return key


def usable_blocks(held: int, prompt_tokens: int, block_size: int) -> int:
    """Leading blocks that can be reused: the last token is always computed."""
    return max(0, min(held, (prompt_tokens - 1) // block_size))


def choose(prompt_tokens: int, block_size: int, decode: Sequence[Candidate], prefill: Sequence[Candidate],
           held_blocks: Mapping[str, int], weights: ScoringWeights, rng: random.Random,
           lower: Mapping[str, LowerHeld] | None = None) -> Choice:
    """The cheapest option over every decode worker (and prefill worker). decode must be non-empty.
    lower: of held_blocks, those in each worker's lower tiers (none when absent)."""
    if not decode:
        raise ValueError("no decode worker to choose from")
    lower = lower or {}
    feeders = _cheapest_prefill(prompt_tokens, block_size, prefill, held_blocks, lower, weights)
    options = [option for d in decode
               for option in _options(prompt_tokens, block_size, d, feeders, held_blocks, lower, weights)]
    best = min(o[_COST] for o in options)
    winner = Choice(*rng.choice([o for o in options if o[_COST] == best]))
    if log.isEnabledFor(logging.DEBUG):
        log.debug("route %d tokens: %s (cost %.1f) among %s", prompt_tokens, _label(winner), winner.cost,
                  ", ".join(f"{_label(Choice(*o))}={o[_COST]:.1f}" for o in options))
    return winner


# An option before it wins: Choice's fields in its order (decode, prefill, cost, decode_cached_blocks,
# prefill_cached_blocks). NOTE: a plain tuple, not a Choice: a decision prices up to D x (tied P)
# options and keeps one, and a frozen dataclass costs ~1 us to build (a third of scoring's time on
# 8 + 8 workers).
_Option = tuple[Candidate, Candidate | None, float, int, int]
_COST = 2


@dataclass(frozen=True)
class _Feeders:
    """The prefill workers tied for the cheapest prefill part of a remote option, which does not
    depend on the decode worker: w_prefill * (T - B * d_P + reload(P)) + w_prefill_load * load(P).
    Only they can be in a cheapest P-then-D option, so each decode worker is priced with them alone
    (D + P work instead of D x P)."""

    cost: float
    workers: tuple[tuple[Candidate, int], ...]  # (P, its usable cached blocks), in the given order


def _cheapest_prefill(tokens: int, bs: int, prefill: Sequence[Candidate], held: Mapping[str, int],
                      lower: Mapping[str, LowerHeld], w: ScoringWeights) -> _Feeders | None:
    if not prefill:
        return None
    parts = []
    for p in prefill:
        p_all = held.get(p.worker_id, 0)
        p_held = usable_blocks(p_all, tokens, bs)
        p_lacking = tokens - bs * p_held + _reload_tokens(p.worker_id, p_all, p_held, lower, bs, w)
        parts.append((w.prefill * p_lacking + w.prefill_load * p.active_requests, p, p_held))
    cost = min(part for part, _, _ in parts)
    return _Feeders(cost, tuple((p, p_held) for part, p, p_held in parts if part == cost))


def _reload_tokens(worker_id: str, held: int, usable: int, lower: Mapping[str, LowerHeld], bs: int,
                   w: ScoringWeights) -> float:
    """What loading back a worker's usable lower-tier blocks costs, in tokens of prefill."""
    tiers = lower.get(worker_id)
    if tiers is None:
        return 0.0
    cut = held - usable  # blocks past the usable cap: the run's last, so lower-tier ones first
    disk = max(0, tiers.disk - cut)
    host = max(0, tiers.host - max(0, cut - tiers.disk))
    return bs * (w.host_reload * host + w.disk_reload * disk)


def _options(tokens: int, bs: int, d: Candidate, feeders: _Feeders | None, held: Mapping[str, int],
             lower: Mapping[str, LowerHeld], w: ScoringWeights) -> list[_Option]:
    n_blocks = ceil_div(tokens, bs)
    d_all = held.get(d.worker_id, 0)
    d_held = usable_blocks(d_all, tokens, bs)
    d_load = w.decode_load * d.active_requests + w.blocks_used * d.used_block_fraction
    lacking = tokens - bs * d_held + _reload_tokens(d.worker_id, d_all, d_held, lower, bs, w)
    local: _Option = (d, None, w.local_prefill * lacking + d_load, d_held, d_held)
    if lacking < w.local_prefill_max_tokens or feeders is None:
        return [local]
    cost = feeders.cost + w.transfer * (n_blocks - d_held) + d_load
    return [local, *((d, p, cost, d_held, p_held) for p, p_held in feeders.workers)]


def _label(c: Choice) -> str:
    return f"{c.prefill.worker_id}->{c.decode.worker_id}" if c.prefill else f"local@{c.decode.worker_id}"
