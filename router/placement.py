"""The router's decision pipeline: tokens -> block hashes -> index match -> score -> pick.

Three policies (--routing):
    prefix       KV-aware: the scorer in router/scoring.py over the prefix index's depths
    least_load   fewest requests in flight (router/policy.py); no index lookups
    round_robin  decode and prefill workers in turn
Admission: when every decode worker already has max_in_flight requests, or the prompt
needs more KV blocks than any decode worker has, the request is refused at once
(AdmissionRefused -> RESOURCE_EXHAUSTED with a retry hint) instead of queueing without
limit. The index is read through a circuit breaker: with Redis down or slow, routing
falls back to load alone after at most one short timeout, and regains cache affinity
when Redis answers again.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.engine.hashing import BlockHash, engine_salt, hash_blocks, request_salt
from pdserve.index.breaker import CircuitBreaker
from router.policy import Candidate, NoWorkerError, place_by_load
from router.scoring import ScoringWeights, WorkerLoad, choose
from router.workers import WorkerDirectory

POLICIES = ("prefix", "least_load", "round_robin")


class AdmissionRefused(RuntimeError):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class PlacementConfig:
    policy: str = "prefix"
    weights: ScoringWeights = field(default_factory=ScoringWeights)
    min_remote_prefill_tokens: int = 32  # least_load / round_robin: shorter prompts stay on D
    kv_dtype: str = "float32"  # part of the block-hash salt, as on the workers
    max_in_flight_per_decode: int = 64

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")


@dataclass(frozen=True)
class Placement:
    decode: Candidate
    prefill: Candidate | None  # None: prefill on the decode worker
    decode_cached_blocks: int = 0  # blocks D holds: the prefill worker does not send them
    policy: str = "least_load"


MatchFn = Callable[[Sequence[BlockHash]], Mapping[str, int]]  # PrefixIndex.match


class Placer:
    def __init__(self, directory: WorkerDirectory, config: PlacementConfig, match: MatchFn | None,
                 breaker: CircuitBreaker | None = None, rng: random.Random | None = None) -> None:
        self.directory, self.config, self.match = directory, config, match
        self.breaker = breaker or directory.breaker  # one view of Redis's health: reads and sweeps
        self.rng = rng or random.Random()
        self._decode_turns, self._prefill_turns = itertools.count(), itertools.count()
        self._lock = threading.Lock()

    def place(self, prompt: list[int], policy: str = "", overrides: Mapping[str, float] | None = None,
              exclude: Collection[str] = (), cache_salt: bytes = b"") -> Placement:
        """NoWorkerError, AdmissionRefused, or ValueError (a bad override) when it cannot place.

        exclude: decode worker ids not to use (they failed this request before its first token).
        cache_salt: the request's own prefix-cache salt (a tenant's): it matches only blocks
        hashed with it.
        """
        policy = policy or self.config.policy
        if policy not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {policy!r}")
        weights = self.config.weights.overridden(overrides or {})
        decode = [c for c in self.directory.candidates("decode") if c.worker_id not in exclude]
        prefill = self.directory.candidates("prefill")
        if not decode and exclude:
            tried = ", ".join(sorted(exclude))
            raise NoWorkerError(f"every decode worker that could take this request ({tried}) was "
                                "unavailable; retry shortly")
        self._admit(len(prompt), decode)
        if policy == "prefix":
            return self._by_prefix(prompt, decode, prefill, weights, cache_salt)
        if policy == "round_robin":
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

    def _by_prefix(self, prompt: list[int], decode, prefill, weights: ScoringWeights,
                   cache_salt: bytes) -> Placement:
        block_size, salt = self._hash_params()
        held: Mapping[str, int] = {}
        if self.match is not None and salt is not None:
            hashes = hash_blocks(prompt, block_size, request_salt(salt, cache_salt))
            held = self.breaker.call(lambda: self.match(hashes), {}) if hashes else {}
        loads = [WorkerLoad(c.worker_id, c.address, c.active_requests,
                            self.directory.used_block_fraction(c.worker_id)) for c in decode]
        p_loads = [WorkerLoad(c.worker_id, c.address, c.active_requests) for c in prefill]
        choice = choose(len(prompt), block_size, loads, p_loads, held, weights, self.rng)
        by_id = {c.worker_id: c for c in [*decode, *prefill]}
        chosen_prefill = by_id[choice.prefill.worker_id] if choice.prefill else None
        return Placement(by_id[choice.decode.worker_id], chosen_prefill, choice.decode_cached_blocks,
                         "prefix")

    def _hash_params(self) -> tuple[int, bytes | None]:
        workers = self.directory.workers()
        if not workers:
            return 16, None
        first = workers[0]
        return first.block_size, engine_salt(first.model_fingerprint, first.block_size, self.config.kv_dtype)

    def _round_robin(self, prompt_tokens: int, decode, prefill) -> Placement:
        remote = bool(prefill) and prompt_tokens >= self.config.min_remote_prefill_tokens
        with self._lock:
            d_turn = next(self._decode_turns)
            p_turn = next(self._prefill_turns) if remote else 0
        # NOTE: separate counters, so with equal numbers of each, P_i does not always feed D_i.
        d = sorted(decode, key=lambda c: c.worker_id)[d_turn % len(decode)]
        p = sorted(prefill, key=lambda c: c.worker_id)[p_turn % len(prefill)] if remote else None
        return Placement(d, p, 0, "round_robin")
