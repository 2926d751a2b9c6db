"""What an engine accepts: each check runs before anything is queued or held, so a bad request
raises InvalidRequestError (its message names the field and the limit) and the engine keeps
serving the others.

Used by LLMEngine.add_request and by the KV hand-off (engine/handoff.py), which checks an
incoming transfer's prompt and a resuming request's fields against the same limits. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.hashing import MAX_CACHE_SALT_BYTES
from pdserve.engine.sequence import SamplingParams


class InvalidRequestError(ValueError):
    """The request is malformed or cannot fit; the message names the field and the limit."""


@dataclass(frozen=True)
class EngineLimits:
    """One engine's limits: its vocabulary and its context (max_model_len tokens)."""

    vocab_size: int
    max_model_len: int

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("prompt is empty: give at least 1 token")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids):,} tokens; this engine's context is {self.max_model_len:,} "
                f"(the prompt must leave room for at least 1 generated token)")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            self.check_token("prompt token id", bad)  # raises, naming the token and the vocabulary

    def check_sampling(self, sampling: SamplingParams) -> None:
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequestError("sampling must be a SamplingParams")
        bad = next((t for t in sampling.stop_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"sampling.stop_token_ids has {bad}, outside the vocabulary [0, {self.vocab_size})")
        if sampling.logprobs is not None and sampling.logprobs > self.vocab_size:
            raise InvalidRequestError(f"sampling.logprobs is {sampling.logprobs:,}; this engine's vocabulary "
                                      f"has {self.vocab_size:,} tokens to rank")

    def check_token(self, field_name: str, token: int) -> None:
        vocab = self.vocab_size
        if not 0 <= token < vocab:
            raise InvalidRequestError(f"{field_name} {token} is outside the vocabulary [0, {vocab})")


def check_cache_salt(value: bytes) -> None:
    if len(value) > MAX_CACHE_SALT_BYTES:
        raise InvalidRequestError(f"cache_salt has {len(value)} bytes; at most {MAX_CACHE_SALT_BYTES}")


def check_rng_state(rng_state: torch.Tensor) -> None:
    """rng_state must be a state of the engine's per-request generator (a CPU torch.Generator)."""
    try:
        torch.Generator().set_state(rng_state)
    except (RuntimeError, TypeError, ValueError) as e:
        raise InvalidRequestError(f"rng_state ({rng_state.numel()} bytes) is not a state of this "
                                  f"engine's generator: {e}") from None
