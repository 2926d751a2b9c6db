"""The router's decision pipeline: tokens -> block hashes -> index match -> score -> pick.

Three routing policies (--routing; router/config.py ROUTING_POLICIES):
    prefix       KV-aware: the scorer in router/scoring.py over the prefix index's depths
    least_load   fewest requests in flight (router/least_load.py); no index lookups
    round_robin  decode and prefill workers in turn
Admission: when every decode worker already has max_in_flight requests, or the prompt
needs more KV blocks than any decode worker has, the request is refused at once
(AdmissionRefused -> RESOURCE_EXHAUSTED with a retry hint) instead of queueing without
limit. The index is read through a circuit breaker: with Redis down or slow, routing
falls back to load alone after at most one short timeout, and regains cache affinity
when Redis answers again.

Prefix routing hashes the prompt as the workers it scores hash their blocks: with the block size
and engine salt each one publishes in its registry entry (pdserve/index/registry.py WorkerInfo).
Workers whose salts differ (a rolling upgrade to new weights, another KV dtype) are scored in
groups, one per (block size, salt), each matched with its own hashes; a prefill worker is paired
only with decode workers of its group, since their KV layouts are the same; the cheapest choice
of any group wins.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from pdserve.engine.hashing import BlockHash, PromptHashes, request_salt
from pdserve.index.breaker import CircuitBreaker
from router.config import ROUTING_POLICIES, PlacementConfig
from router.least_load import NoWorkerError, place_by_load
from router.limits import RetryLater
from router.scoring import Candidate, Choice, LowerHeld, ScoringWeights, choose, held_by_tier
from router.workers import BlockHashing, WorkerDirectory


class AdmissionRefused(RetryLater):
    """Every decode worker is at its in-flight bound, or none can hold the prompt's KV."""


@dataclass(frozen=True)
class Placement:
    decode: Candidate
    prefill: Candidate | None  # None: prefill on the decode worker
    decode_cached_blocks: int = 0  # blocks D holds: the prefill worker does not send them
    routing: str = "least_load"
    # What the index promised the worker that computes the prompt (prefill, else decode): the cached
    # tokens of the usable leading blocks it holds. None: no prediction (another policy, or the index
    # did not answer).
    predicted_cached_tokens: int | None = None

    @property
    def computing_worker(self) -> Candidate:
        return self.prefill or self.decode


MatchFn = Callable[[Sequence[BlockHash]], Mapping[str, int]]  # PrefixIndex.match


class Placer:
    def __init__(self, directory: WorkerDirectory, config: PlacementConfig, match: MatchFn | None,
                 breaker: CircuitBreaker | None = None, rng: random.Random | None = None) -> None:
        self.directory, self.config, self.match = directory, config, match
        self.breaker = breaker or directory.breaker  # one view of Redis's health: reads and sweeps
        self.rng = rng or random.Random()
        self._decode_turns, self._prefill_turns = itertools.count(), itertools.count()
        self._lock = threading.Lock()

    def place(self, prompt: list[int], routing: str = "", overrides: Mapping[str, float] | None = None,
              exclude: Collection[str] = (), cache_salt: bytes = b"") -> Placement:
        """NoWorkerError, AdmissionRefused, or ValueError (a bad override) when it cannot place.

        routing: the request's own routing policy ("": the configured one).
        exclude: decode worker ids not to use (they failed this request before its first token).
        cache_salt: the request's own prefix-cache salt (a tenant's): it matches only blocks
        hashed with it.
        """
        routing = routing or self.config.routing
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {routing!r}")
        weights = self.config.weights.overridden(overrides or {})
        decode = [c for c in self.directory.candidates("decode") if c.worker_id not in exclude]
        prefill = self.directory.candidates("prefill")
        if not decode and exclude:
            tried = ", ".join(sorted(exclude))
            raise NoWorkerError(f"every decode worker that could take this request ({tried}) was "
                                "unavailable; retry shortly")
        self._admit(len(prompt), decode)
        if routing == "prefix":
            return self._by_prefix(prompt, decode, prefill, weights, cache_salt)
        if routing == "round_robin":
            return self._round_robin(len(prompt), decode, prefill)
        d, p = place_by_load(prefill, decode, len(prompt), self.config.min_remote_prefill_tokens, self.rng)
        return Placement(d, p, 0, "least_load")

    def _admit(self, prompt_tokens: int, decode: list[Candidate]) -> None:
        if not decode:
            raise NoWorkerError("no live decode worker; is the cluster up (`pdserve status`)?")
        bound = self.config.max_in_flight_per_decode
        if all(c.active_requests >= bound for c in decode):
            raise AdmissionRefused(f"all {len(decode)} decode workers have {bound} requests in flight; "
                                   "retry shortly", retry_after_s=1.0)
        capacity = max((self.directory.capacity_tokens(c.worker_id) for c in decode), default=0)
        if capacity and prompt_tokens >= capacity:
            raise AdmissionRefused(f"prompt has {prompt_tokens:,} tokens; the largest decode worker's KV "
                                   f"pool holds {capacity:,}", retry_after_s=0.0)

    def _by_prefix(self, prompt: list[int], decode: list[Candidate], prefill: list[Candidate],
                   weights: ScoringWeights, cache_salt: bytes) -> Placement:
        groups = self._salt_groups(decode, prefill)
        if not groups:  # every candidate left the directory since it was listed
            raise NoWorkerError("no live decode worker; is the cluster up (`pdserve status`)?")
        choices = [self._choose_in(hashing, d, p, prompt, weights, cache_salt)
                   for hashing, (d, p) in groups.items()]
        best = min(c.cost for c, _ in choices)
        ties = [(c, predicted) for c, predicted in choices if c.cost == best]
        choice, predicted = ties[0] if len(ties) == 1 else self.rng.choice(ties)
        return Placement(choice.decode, choice.prefill, choice.decode_cached_blocks, "prefix", predicted)

    def _salt_groups(self, decode: list[Candidate], prefill: list[Candidate]
                     ) -> dict[BlockHashing, tuple[list[Candidate], list[Candidate]]]:
        """The candidates by how they hash their blocks; only groups with a decode worker."""
        hashing = self.directory.block_hashing()
        groups: dict[BlockHashing, tuple[list[Candidate], list[Candidate]]] = {}
        for c in decode:
            if c.worker_id in hashing:
                groups.setdefault(hashing[c.worker_id], ([], []))[0].append(c)
        for c in prefill:
            if hashing.get(c.worker_id) in groups:
                groups[hashing[c.worker_id]][1].append(c)
        return groups

    def _choose_in(self, hashing: BlockHashing, decode: list[Candidate], prefill: list[Candidate],
                   prompt: list[int], weights: ScoringWeights,
                   cache_salt: bytes) -> tuple[Choice, int | None]:
        """The group's cheapest choice, and the cached tokens the index promised its computing worker
        (None when the index did not answer)."""
        tiered: tuple[dict[str, int], dict[str, LowerHeld]] | None = ({}, {})
        if self.match is not None:
            hashes = PromptHashes(prompt, hashing.block_size, request_salt(hashing.salt, cache_salt))
            with_tiers = self.directory.tiered()
            tiered = (self.breaker.call(lambda: held_by_tier(self.match, hashes, with_tiers), None)
                      if hashes else ({}, {}))
        held, lower = tiered or ({}, {})
        choice = choose(len(prompt), hashing.block_size, decode, prefill, held, weights, self.rng, lower)
        consulted = self.match is not None and tiered is not None
        return choice, choice.prefill_cached_blocks * hashing.block_size if consulted else None

    def _round_robin(self, prompt_tokens: int, decode, prefill) -> Placement:
        remote = bool(prefill) and prompt_tokens >= self.config.min_remote_prefill_tokens
        with self._lock:
            d_turn = next(self._decode_turns)
            p_turn = next(self._prefill_turns) if remote else 0
        # NOTE: separate counters, so with equal numbers of each, P_i does not always feed D_i.
        d = sorted(decode, key=lambda c: c.worker_id)[d_turn % len(decode)]
        p = sorted(prefill, key=lambda c: c.worker_id)[p_turn % len(prefill)] if remote else None
        return Placement(d, p, 0, "round_robin")
