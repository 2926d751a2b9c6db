"""What one Generate request may ask for, checked at the router before any worker is touched.

Pure: no gRPC. Each check raises LimitExceeded (a ValueError: INVALID_ARGUMENT) with a
message that names the limit and the value (and the `pdserve up` flag that sets it, for the
limits an operator is expected to tune), or StreamLimitReached
(RESOURCE_EXHAUSTED with a retry hint) when the router already serves as many streams as
it may. Two limits are enforced by gRPC itself, from the same config: max_message_bytes
(the public server's receive size; a bigger request is RESOURCE_EXHAUSTED before it is
parsed) and, as a backstop, the server's concurrent-RPC cap (router/server.py).

Lengths, for a prompt of P tokens, a model context of C tokens (max_context_tokens) and max_tokens M:
    P <= max_prompt_tokens, and P <= C - 1 (one generated token must fit)
    M given:  M <= max_tokens_limit and P + M <= C (as vLLM: its 400 for prompt + max_tokens
              over max_model_len)
    M absent: M = min(default_max_tokens, max_tokens_limit, C - P): a default never fails
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from pdserve.engine.sequence import SamplingParams
from pdserve.field_error import FieldError
from pdserve.settings import not_a_setting, setting

# Why a bound below is not a setting.
_FIXED = "a bound on one request's size against abuse, fixed here (as vLLM's)"


class LimitExceeded(ValueError):
    """The request asks for more than this server allows; the message names the limit."""


class RetryLater(RuntimeError):
    """Refused for now: RESOURCE_EXHAUSTED, with a hint of when to try again (retry-after-ms)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StreamLimitReached(RetryLater):
    """The router already serves max_concurrent_streams Generate calls."""


@dataclass(frozen=True)
class RequestLimits:
    """What one Generate call may ask of the router; more is refused before any worker is touched."""

    # The model's context; None: unknown here, the workers still refuse what does not fit theirs.
    max_context_tokens: int | None = not_a_setting(None, why="the launcher reads it from the model")
    max_prompt_tokens: int | None = setting(
        None, flag="--max-prompt-tokens", key="router.max_prompt_tokens", metavar="N",
        help="longest prompt in tokens, INVALID_ARGUMENT beyond (default: the model's context - 1)")
    max_tokens_limit: int = setting(4096, flag="--max-tokens-limit", key="router.max_tokens_limit",
                                    metavar="N", help="largest max_tokens a request may ask for")
    # when a request leaves max_tokens unset (capped as above)
    default_max_tokens: int = not_a_setting(128, why="what a request that sets no max_tokens gets; clients "
                                                     "set their own")
    max_message_bytes: int = setting(4 << 20, flag="--max-message-bytes", key="router.max_message_bytes",
                                     metavar="BYTES", help="largest request message the router accepts; "
                                                           "RESOURCE_EXHAUSTED beyond")
    max_concurrent_streams: int = setting(
        256, flag="--max-concurrent-streams", key="router.max_concurrent_streams", metavar="N",
        help="Generate calls in flight at the router; more are refused with RESOURCE_EXHAUSTED and a retry "
             "hint")
    max_chat_messages: int = not_a_setting(1024, why=_FIXED)
    max_stop_strings: int = not_a_setting(16, why=_FIXED)
    max_stop_string_chars: int = not_a_setting(256, why=_FIXED)
    max_stop_token_ids: int = not_a_setting(64, why=_FIXED)
    max_request_id_chars: int = not_a_setting(256, why=_FIXED)
    # top alternatives per token (OpenAI's top_logprobs allows 0..20)
    max_logprobs: int = not_a_setting(20, why=_FIXED)
    stream_retry_after_s: float = not_a_setting(1.0, why="the hint sent with a refused stream")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not value > 0:
                raise FieldError(f.name, "must be > 0", value)


def check_request_id(request_id: str, limits: RequestLimits) -> None:
    if len(request_id) > limits.max_request_id_chars:
        raise LimitExceeded(f"request_id has {len(request_id):,} characters; this server's limit is "
                            f"{limits.max_request_id_chars:,}")


def check_chat(num_messages: int, limits: RequestLimits) -> None:
    if num_messages > limits.max_chat_messages:
        raise LimitExceeded(f"chat has {num_messages:,} messages; this server's limit is "
                            f"{limits.max_chat_messages:,}")


def check_sampling(sampling: SamplingParams, vocab_size: int, limits: RequestLimits) -> None:
    """Stop conditions: counts, lengths, and stop token ids inside the vocabulary; the logprobs asked
    (NOTE: they bound the stream's size: each alternative adds about 11 bytes per token)."""
    if len(sampling.stop) > limits.max_stop_strings:
        raise LimitExceeded(f"sampling.stop has {len(sampling.stop):,} strings; this server's limit is "
                            f"{limits.max_stop_strings:,}")
    longest = max((len(s) for s in sampling.stop), default=0)
    if longest > limits.max_stop_string_chars:
        raise LimitExceeded(f"a sampling.stop string has {longest:,} characters; this server's limit is "
                            f"{limits.max_stop_string_chars:,}")
    if len(sampling.stop_token_ids) > limits.max_stop_token_ids:
        raise LimitExceeded(f"sampling.stop_token_ids has {len(sampling.stop_token_ids):,} ids; this "
                            f"server's limit is {limits.max_stop_token_ids:,}")
    bad = next((t for t in sampling.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise LimitExceeded(f"sampling.stop_token_ids has {bad}, outside the vocabulary [0, {vocab_size})")
    if sampling.logprobs is not None and sampling.logprobs > limits.max_logprobs:
        raise LimitExceeded(f"sampling.logprobs {sampling.logprobs:,} exceeds this server's limit of "
                            f"{limits.max_logprobs:,} top alternatives")


def check_prompt(prompt_tokens: int, context_tokens: int | None, limits: RequestLimits) -> None:
    if context_tokens is not None and prompt_tokens >= context_tokens:
        raise LimitExceeded(f"prompt has {prompt_tokens:,} tokens; this model's context is "
                            f"{context_tokens:,} (the prompt must leave room for at least 1 generated token)")
    limit = limits.max_prompt_tokens
    if limit is not None and prompt_tokens > limit:
        raise LimitExceeded(f"prompt has {prompt_tokens:,} tokens; this server's limit is {limit:,} "
                            "(--max-prompt-tokens)")


def resolve_max_tokens(requested: int | None, prompt_tokens: int, context_tokens: int | None,
                       limits: RequestLimits) -> int:
    """The max_tokens to run with; requested is None when the request left it unset."""
    room = None if context_tokens is None else context_tokens - prompt_tokens
    if requested is None:
        return min(b for b in (limits.default_max_tokens, limits.max_tokens_limit, room) if b is not None)
    if requested > limits.max_tokens_limit:
        raise LimitExceeded(f"max_tokens {requested:,} exceeds this server's limit of "
                            f"{limits.max_tokens_limit:,} (--max-tokens-limit)")
    if room is not None and requested > room:
        raise LimitExceeded(f"prompt ({prompt_tokens:,} tokens) + max_tokens ({requested:,}) = "
                            f"{prompt_tokens + requested:,} exceeds this model's context of "
                            f"{context_tokens:,} tokens; ask for at most {room:,} new tokens or shorten "
                            "the prompt")
    return requested


def check_streams(in_flight: int, limits: RequestLimits) -> None:
    """Before admitting one more stream; in_flight counts those already admitted."""
    if in_flight >= limits.max_concurrent_streams:
        retry_ms = int(limits.stream_retry_after_s * 1000)
        raise StreamLimitReached(
            f"{in_flight:,} Generate streams are in flight; this server's limit is "
            f"{limits.max_concurrent_streams:,} (--max-concurrent-streams); retry after {retry_ms} ms",
            limits.stream_retry_after_s)
