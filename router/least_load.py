"""Placement by load alone: which decode worker, and whether a prefill worker computes the prompt.

Pure: no I/O. The random source is a parameter so tests are deterministic.

    decode worker  = the live decode worker with the fewest active requests (ties: random)
    prefill worker = the live prefill worker with the fewest active requests, unless the
                     prompt is shorter than min_remote_prefill_tokens or there is none,
                     in which case the decode worker prefills it (no transfer)
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.scoring import Candidate


class NoWorkerError(RuntimeError):
    """No live worker can take the request."""


def least_loaded(candidates: Sequence[Candidate], rng: random.Random) -> Candidate:
    if not candidates:
        raise NoWorkerError("no live worker")
    fewest = min(c.active_requests for c in candidates)
    return rng.choice([c for c in candidates if c.active_requests == fewest])


def place_by_load(prefill: Sequence[Candidate], decode: Sequence[Candidate], prompt_tokens: int,
                  min_remote_prefill_tokens: int, rng: random.Random) -> tuple[Candidate, Candidate | None]:
    """(decode worker, prefill worker or None for prefill on the decode worker)."""
    if not decode:
        raise NoWorkerError("no live decode worker; is the cluster up (`pdserve status`)?")
    chosen_decode = least_loaded(decode, rng)
    if not prefill or prompt_tokens < min_remote_prefill_tokens:
        return chosen_decode, None
    return chosen_decode, least_loaded(prefill, rng)
