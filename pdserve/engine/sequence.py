"""Request state inside one engine.

Lifecycle of a Sequence:

    WAITING --schedule--> RUNNING --last token / stop / max_tokens--> FINISHED_*
       ^                    |
       +----- preempt ------+   (blocks released, KV recomputed on resume)
    any state --abort--> FINISHED_ABORTED (blocks released at once)

A RUNNING sequence is prefilling while num_computed_tokens < len(prompt) and
decoding afterwards; chunked prefill may take several steps.

A continued sequence (a stream migrated from another worker: router/service.py) starts with the
tokens an earlier run of the same request generated after its prompt (`generated`): they are
computed like the prompt (or taken from the prefix cache), but count as output: completion
tokens, max_tokens, stop strings, the text. Sampling draws by (seed, position) (engine/sampler.py),
so the tokens it goes on to draw are the ones the earlier run would have drawn.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from pdserve.engine.hashing import ROOT_PARENT, BlockHash, hash_block


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


GREEDY_BELOW = 1e-5  # a smaller temperature samples as greedy (as vLLM does)
# NOTE: logits / temperature overflows float32 to inf once temperature is below ~1e-37, and the
# softmax is then NaN; long before that the distribution is the argmax anyway.


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 (or below GREEDY_BELOW) is greedy; top_k 0 and top_p 1
    are off. seed: any uint64. logprobs: None returns none; k >= 0 returns each sampled token's
    log-probability and its k most likely alternatives (TokenLogprob)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {min(self.stop_token_ids)}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 (the number of top alternatives), got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log-probability and its top alternatives, from the raw float32 logits
    the sampler received (before temperature, top-k and top-p, as vLLM's default "raw_logprobs"),
    so they describe the model, not the filters. top: (token id, logprob), sorted by logprob
    descending, ties broken by the lower token id; as long as the request's logprobs asked."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Usage:
    """A continued sequence's prompt_tokens is its original prompt's; its completion_tokens count the
    tokens generated before it was continued too; its cached and computed tokens are of what it
    replayed at admission (prompt + those tokens)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # tokens served from the prefix cache at admission (every tier)
    host_cached_tokens: int = 0  # of cached_tokens, those loaded back from the host tier
    disk_cached_tokens: int = 0  # of cached_tokens, those loaded back from the disk tier
    computed_tokens: int = 0  # tokens this request had to compute at admission
    completion_tokens: int = 0
    preemptions: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "host_cached_tokens": self.host_cached_tokens, "disk_cached_tokens": self.disk_cached_tokens,
                "computed_tokens": self.computed_tokens,
                "completion_tokens": self.completion_tokens}


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival: int
    token_ids: list[int] = field(init=False)
    status: SequenceStatus = SequenceStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_committed_blocks: int = 0
    admitted_once: bool = False
    usage: Usage = field(default_factory=Usage)
    seed: int = 0  # the key of its draws (engine/sampler.py uniform): sampling.seed, or the engine's pick
    generated: tuple[int, ...] = ()  # a continued sequence: what an earlier run generated (see above)
    cache_salt: bytes = b""  # the request's own prefix-cache salt (a tenant's); b"": none
    text: str = ""
    _block_hashes: list[BlockHash] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids = [*self.prompt_token_ids, *self.generated]
        self.usage.prompt_tokens = len(self.prompt_token_ids)
        self.usage.completion_tokens = len(self.generated)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    def full_block_hashes(self, block_size: int, salt: bytes) -> list[BlockHash]:
        """Chained hashes of every full block of token_ids (extended incrementally)."""
        hashes = self._block_hashes
        while (len(hashes) + 1) * block_size <= self.num_tokens:
            start = len(hashes) * block_size
            parent = hashes[-1] if hashes else ROOT_PARENT
            hashes.append(hash_block(parent, self.token_ids[start:start + block_size], salt))
        return hashes
