"""The KV hand-off state of one engine: the blocks a prompt's KV occupies while it moves from a
prefill engine to a decode engine.

Decode side. One incoming prompt's KV is a Reservation, and goes

    reserve ──▶ RESERVED ──(the receiver writes every block)──▶ park ──▶ PARKED ──claim──▶ resumed
                   │                                                      ├─ expire: expires_at passed
                   └─ release: the transfer failed                        └─ drop: abort, a refused resume,
                                                                             a Decode call that failed

    RESERVED  block_ids cover the whole prompt: the receiver's own cached prefix (acquired: the
              first num_cached_blocks) and fresh blocks the transfer fills. Nothing reads them but
              the receiver, which holds the Reservation and releases it if the transfer fails.
    PARKED    the KV is complete and the prompt's full blocks are committed to the prefix cache
              (their BlockStored events go out); it waits for its Decode call until expires_at,
              after which the engine's next step frees it.
    resumed   claim() checked the resuming request against what was parked (prompt, or prompt +
              generated for a continued stream, cache_salt, first_token, sampling, first_logprob)
              and handed the blocks to the caller:
              the engine's new sequence owns them from then on. A check that fails drops the parked
              KV, so a bad resume leaves nothing held.

At most one reservation per request id is held, RESERVED or PARKED: a second BEGIN for an id
whose KV is in flight or parked is refused (InvalidRequestError), so one transfer can never
park over, or release, another's blocks.

Prefill side. A KV sender reads blocks on its own thread, so it holds its own reference on each
block it was offered (pin) until its transfer ends (unpin): preemption cannot hand those blocks
to another request while they are read. The sender counts its pins (prefill_worker/sender.py).

One owner: KVHandoff alone reads and changes the reservations it holds. Every method takes the
engine's lock (the RLock the engine steps under), except num_parked: one len(), read without the
lock for LLMEngine.load (see its docstring). No I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container
from contextlib import AbstractContextManager
from dataclasses import dataclass

from pdserve.engine.block_pool import BlockPool, NoFreeBlocksError
from pdserve.engine.hashing import hash_blocks, request_salt
from pdserve.engine.sequence import SamplingParams, TokenLogprob
from pdserve.engine.validation import EngineLimits, InvalidRequestError, check_cache_salt
from pdserve.units import ceil_div


class TransferRejected(RuntimeError):
    """The receiver cannot accept a KV transfer as described (e.g. its cached prefix is gone)."""


@dataclass
class Reservation:
    """Blocks held on a decode engine for one incoming prompt's KV.

    block_ids covers the whole prompt: the first num_cached_blocks are the
    receiver's own cached prefix (acquired), the rest are fresh and filled by
    the transfer. expires_at bounds how long a parked transfer may wait for
    its Decode call.
    """

    request_id: str
    prompt_token_ids: list[int]
    block_ids: list[int]
    num_cached_blocks: int
    expires_at: float = float("inf")
    cache_salt: bytes = b""  # the request's own prefix-cache salt, as the sender hashed under


class KVHandoff:
    """Reservations and parked transfers of one engine, and the sender's pins on its blocks."""

    def __init__(self, pool: BlockPool, salt: bytes, limits: EngineLimits, lock: AbstractContextManager,
                 in_flight: Container[str], publish_events: Callable[[], None]) -> None:
        """lock: the engine's RLock (re-entrant: claim drops, drop releases, under it); in_flight:
        the engine's live request ids (read only: never reserved or resumed over); publish_events:
        ship the pool's events now."""
        self._pool, self._salt, self._limits, self._lock = pool, salt, limits, lock
        self._in_flight = in_flight
        self._publish_events = publish_events
        self._reserved: dict[str, Reservation] = {}
        self._parked: dict[str, Reservation] = {}

    # --- decode side ----------------------------------------------------------------------
    def reserve(self, request_id: str, prompt_token_ids: list[int], decode_cached_blocks: int,
                ttl_s: float = 30.0, cache_salt: bytes = b"") -> Reservation:
        """Hold blocks for an incoming prompt's KV: the decode_cached_blocks leading blocks the router
        found this engine holding (the sender skips them) plus fresh blocks for the rest.

        Raises InvalidRequestError for a bad prompt or an id already in flight, TransferRejected
        when this engine no longer holds that prefix (the sender would skip blocks we lack), and
        NoFreeBlocksError when the pool is full; nothing is held then.
        """
        with self._lock:
            self._check_new(request_id, prompt_token_ids, cache_salt)
            salt = request_salt(self._salt, cache_salt)
            cached = self._acquire_cached_prefix(prompt_token_ids, decode_cached_blocks, salt)
            total = ceil_div(len(prompt_token_ids), self._pool.block_size)
            try:
                fresh = self._pool.allocate(total - len(cached))
            except NoFreeBlocksError:
                self._pool.release(cached)
                raise
            reservation = Reservation(request_id, list(prompt_token_ids), cached + fresh, len(cached),
                                      time.monotonic() + ttl_s, cache_salt)
            self._reserved[request_id] = reservation
            return reservation

    def release(self, reservation: Reservation) -> None:
        """Free a reservation's blocks: a transfer that failed, or a resume that raised after its
        claim. Call once per reservation."""
        with self._lock:
            self._forget(reservation)
            self._pool.release(reservation.block_ids)
            self._publish_events()

    def park(self, reservation: Reservation) -> None:
        """All KV arrived and verified: commit the prompt's full blocks and wait for Decode."""
        with self._lock:
            prompt, salt = reservation.prompt_token_ids, request_salt(self._salt, reservation.cache_salt)
            hashes = hash_blocks(prompt, self._pool.block_size, salt)
            self._pool.commit_blocks(reservation.block_ids, hashes, prompt,
                                     start=reservation.num_cached_blocks)
            self._forget(reservation)
            self._parked[reservation.request_id] = reservation
            self._publish_events()

    def claim(self, request_id: str, prompt_token_ids: list[int], first_token: int, sampling: SamplingParams,
              cache_salt: bytes, first_logprob: TokenLogprob | None = None,
              generated: tuple[int, ...] = ()) -> Reservation | None:
        """Hand the KV parked for request_id to a resuming request; the caller owns its blocks then.

        None when nothing is parked under request_id. InvalidRequestError when the request does
        not match what was parked or a field is out of range: the parked KV is freed then.
        first_logprob: first_token's logprob from the prefill engine, exactly when sampling asks;
        generated: a continued stream's tokens so far, whose KV came after the prompt's.
        """
        with self._lock:
            reservation = self._parked.get(request_id)
            if reservation is None:
                return None
            try:
                self._check_resume(reservation, prompt_token_ids, first_token, sampling, cache_salt,
                                   first_logprob, generated)
            except InvalidRequestError:
                self.drop(request_id)
                raise
            del self._parked[request_id]
            return reservation

    def drop(self, request_id: str) -> bool:
        """Free the KV parked for request_id, if any; True when there was some. A transfer still in
        flight (RESERVED) is its receiver's to release, not dropped here."""
        with self._lock:
            reservation = self._parked.get(request_id)
            if reservation is None:
                return False
            self.release(reservation)
            return True

    def expire(self, now: float) -> None:
        """Free every parked transfer whose expires_at has passed (the engine's step calls this)."""
        with self._lock:
            for reservation in [r for r in self._parked.values() if r.expires_at <= now]:
                self.release(reservation)

    def is_parked(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._parked

    def num_parked(self) -> int:
        """Parked transfers, read WITHOUT the lock: one len(), atomic under the GIL."""
        return len(self._parked)

    # --- prefill side ---------------------------------------------------------------------
    def pin(self, block_ids: list[int]) -> None:
        """One more reference on each block, for the KV sender that reads them off the engine's
        thread: they cannot be handed to another request until unpin."""
        with self._lock:
            self._pool.acquire(block_ids)

    def unpin(self, block_ids: list[int]) -> None:
        with self._lock:
            self._pool.release(block_ids)

    # --- internals ------------------------------------------------------------------------
    def _check_new(self, request_id: str, prompt_token_ids: list[int], cache_salt: bytes) -> None:
        if request_id in self._in_flight:
            raise InvalidRequestError(f"request_id {request_id!r} is already in flight")
        self._limits.check_prompt(prompt_token_ids)
        check_cache_salt(cache_salt)
        if request_id in self._parked:
            raise InvalidRequestError(f"request_id {request_id!r} already has a KV reservation")
        if request_id in self._reserved:
            raise InvalidRequestError(f"request_id {request_id!r} already has a KV transfer in flight; "
                                      "one transfer per request")

    def _acquire_cached_prefix(self, prompt_token_ids: list[int], decode_cached_blocks: int,
                               salt: bytes) -> list[int]:
        block_size, cached = self._pool.block_size, decode_cached_blocks
        max_blocks = (len(prompt_token_ids) - 1) // block_size
        if not 0 <= cached <= max_blocks:
            raise TransferRejected(f"decode_cached_blocks must be in [0, {max_blocks}], got {cached}")
        hashes = hash_blocks(prompt_token_ids[:cached * block_size], block_size, salt)
        matched = self._pool.acquire_prefix(hashes).block_ids  # a lower tier's blocks are loaded back
        if len(matched) < cached:
            self._pool.release(matched)
            raise TransferRejected(
                f"receiver holds {len(matched)} of the {cached} prefix blocks the sender skips; "
                f"retry with decode_cached_blocks={len(matched)}")
        return matched

    def _forget(self, reservation: Reservation) -> None:
        """Stop tracking reservation (only this one: never another transfer under its id)."""
        for held in (self._reserved, self._parked):
            if held.get(reservation.request_id) is reservation:
                del held[reservation.request_id]

    def _check_resume(self, reservation: Reservation, prompt: list[int], first_token: int,
                      sampling: SamplingParams, cache_salt: bytes, first_logprob: TokenLogprob | None,
                      generated: tuple[int, ...]) -> None:
        rid = reservation.request_id
        if rid in self._in_flight:
            raise InvalidRequestError(f"request_id {rid!r} is already in flight")
        replayed = [*prompt, *generated]
        if replayed != reservation.prompt_token_ids:
            raise InvalidRequestError(_prompt_mismatch(rid, replayed, reservation.prompt_token_ids,
                                                       bool(generated)))
        if cache_salt != reservation.cache_salt:
            raise InvalidRequestError(f"cache_salt differs from the one request {rid!r}'s KV was transferred "
                                      "under; send Decode the cache_salt that was sent to Prefill")
        self._limits.check_token("first_token", first_token)
        self._limits.check_sampling(sampling)
        self._limits.check_first_logprob(first_token, first_logprob, sampling)
        self._limits.check_continuation(len(prompt), generated, sampling)


def _prompt_mismatch(request_id: str, given: list[int], parked: list[int], continued: bool) -> str:
    at = next((i for i, (a, b) in enumerate(zip(given, parked)) if a != b), min(len(given), len(parked)))
    what = "prompt_token_ids + generated_token_ids" if continued else "prompt_token_ids"
    return (f"{what} ({len(given)} tokens) differ from the prompt whose KV was transferred for request "
            f"{request_id!r} ({len(parked)} tokens), first at token {at}; send Decode the prompt that was "
            "sent to Prefill")
