"""What an engine accepts: each check runs before anything is queued or held, so a bad request
raises InvalidRequestError (its message names the field and the limit) and the engine keeps
serving the others.

Used by LLMEngine.add_request and by the KV hand-off (engine/handoff.py), which checks an
incoming transfer's prompt and a resuming request's fields against the same limits. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.hashing import MAX_CACHE_SALT_BYTES
from pdserve.engine.sequence import SamplingParams, TokenLogprob


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

    def check_continuation(self, prompt_tokens: int, generated: tuple[int, ...],
                           sampling: SamplingParams) -> None:
        """A continued request (engine/sequence.py): its generated tokens are in the vocabulary, fit
        the context with the prompt, and leave at least one token of max_tokens to generate."""
        if not generated:
            return
        for token in generated:
            self.check_token("generated token id", token)
        total = prompt_tokens + len(generated)
        if total >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({prompt_tokens:,} tokens) and generated ({len(generated):,}) have {total:,} "
                f"tokens; this engine's context is {self.max_model_len:,} (they must leave room for 1 more)")
        if len(generated) >= sampling.max_tokens:
            raise InvalidRequestError(
                f"generated has {len(generated):,} tokens and sampling.max_tokens is "
                f"{sampling.max_tokens:,}: nothing is left to generate (a finished request is not continued)")

    def check_first_logprob(self, first_token: int, logprob: TokenLogprob | None,
                            sampling: SamplingParams) -> None:
        """A resumed request's first-token logprob came over the wire from the prefill worker: it must
        be there exactly when sampling asks, be first_token's, and rank sampling.logprobs tokens of
        this vocabulary, so the decode stream never carries a logprob of another shape or token."""
        asked = sampling.logprobs
        if (logprob is None) != (asked is None):
            raise InvalidRequestError(
                f"first_logprob is {'missing' if logprob is None else 'given'} but sampling.logprobs is "
                f"{asked}; send Decode the first_logprob the prefill worker returned for this sampling")
        if logprob is None:
            return
        if logprob.token_id != first_token:
            raise InvalidRequestError(f"first_logprob is for token {logprob.token_id}, not first_token "
                                      f"{first_token}")
        if len(logprob.top) != asked:
            raise InvalidRequestError(f"first_logprob.top has {len(logprob.top)} alternatives; "
                                      f"sampling.logprobs asks for {asked}")
        for token, value in ((logprob.token_id, logprob.logprob), *logprob.top):
            self.check_token("first_logprob token id", token)
            if not value <= 0:  # also refuses NaN
                raise InvalidRequestError(f"first_logprob of token {token} is {value}; a logprob is <= 0")

    def check_token(self, field_name: str, token: int) -> None:
        vocab = self.vocab_size
        if not 0 <= token < vocab:
            raise InvalidRequestError(f"{field_name} {token} is outside the vocabulary [0, {vocab})")


def check_cache_salt(value: bytes) -> None:
    if len(value) > MAX_CACHE_SALT_BYTES:
        raise InvalidRequestError(f"cache_salt has {len(value)} bytes; at most {MAX_CACHE_SALT_BYTES}")
