"""Workloads: seeded generators of request specs. Pure: no I/O, no clock.

Each workload is a frozen dataclass of its parameters with a `requests(count, rng)` method
that yields `RequestSpec`s. The same parameters, count and seed give the same specs.

Lengths. Prompts are built from WORDS, common English words that are each one token for
byte-level BPE tokenizers (checked for SmolLM2's in tests/loadtest/test_workloads.py), so a
content of n words is about n tokens. A "tokens" parameter below counts the words of the
message contents; the chat template adds its own tokens on top (about 5 per message, plus a
default system prompt where the template inserts one: SmolLM2's adds about 20 tokens when no
system message is given). The exact count is in each reply's usage.prompt_tokens, which the
report sums. With `token_ids=True` (synthetic, mixed) prompts are token ids and exact.

Multi-turn. A spec carries only the messages new in its turn. `ConversationHistory` keeps
each conversation's earlier turns and the assistant replies that came back, and builds the
full message list of the next turn; the runner sends turn k+1 only after turn k's reply.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

WORDS = tuple("""
time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point
home water room mother area money story fact month lot right study book eye job word business issue
side kind head house service friend father power hour game line end member law car city community name
president team minute idea kid body information back parent face others level office door health
person art war history party result change morning reason research girl guy moment air teacher force
education river mountain garden window table chair paper light music color market road street field
island ocean forest bridge village summer winter spring autumn rain snow wind cloud stone fire tree
flower bird fish horse dog cat apple bread milk coffee tea sugar salt train plane ship boat engine
machine computer phone letter picture song dance film theater museum library doctor nurse farmer driver
artist writer singer player captain king queen prince army police court church hospital bank station
hotel restaurant kitchen bedroom floor wall roof yard park lake hill valley desert north south east west
center edge corner surface shape size weight price cost value plan model design method theory energy
heat sound voice signal network data memory space matter language culture nature science math physics
chemistry biology
""".split())

# Token-id prompts draw from this range: ordinary (non-special) tokens in any vocabulary of
# 32k entries or more (Llama 2: 32,000; SmolLM2: 49,152).
TOKEN_ID_RANGE = (1000, 30000)

Message = Mapping[str, str]


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. Exactly one of messages and token_ids is non-empty."""

    index: int  # position in the workload, from 0
    max_tokens: int
    messages: tuple[Message, ...] = ()  # multi-turn: only the messages new in this turn
    token_ids: tuple[int, ...] = ()
    conversation: int | None = None  # multi-turn only
    turn: int = 0  # 0-based turn within the conversation
    kind: str = ""  # sub-population, e.g. "long" / "short" in mixed; reported separately


class Workload(Protocol):
    name: str

    def requests(self, count: int, rng: random.Random) -> Iterator[RequestSpec]: ...


def words(rng: random.Random, n: int) -> str:
    """n words from WORDS, about n tokens."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def token_ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(*TOKEN_ID_RANGE) for _ in range(n))


def spread(rng: random.Random, mean: int, range_ratio: float) -> int:
    """An integer uniform in [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's random-range-ratio)."""
    low, high = math.floor(mean * (1 - range_ratio)), math.ceil(mean * (1 + range_ratio))
    return max(1, rng.randint(low, high))


def _param(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


# --- the workloads ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Synthetic:
    """Independent prompts with random lengths (vLLM's `random` dataset)."""

    name = "synthetic"
    input_tokens: int = _param(256, "mean prompt length in tokens")
    output_tokens: int = _param(64, "mean max_tokens of each request")
    range_ratio: float = _param(0.0, "lengths are uniform in [mean*(1-r), mean*(1+r)]; 0 = fixed")
    token_ids: bool = _param(False, "send token ids (exact lengths, no chat template) instead of chat text")

    def __post_init__(self) -> None:
        _require(self.input_tokens >= 1 and self.output_tokens >= 1,
                 "synthetic: input_tokens and output_tokens must be >= 1")
        _require(0 <= self.range_ratio < 1,
                 f"synthetic: range_ratio must be in [0, 1), got {self.range_ratio}")

    def requests(self, count: int, rng: random.Random) -> Iterator[RequestSpec]:
        for i in range(count):
            n = spread(rng, self.input_tokens, self.range_ratio)
            max_tokens = spread(rng, self.output_tokens, self.range_ratio)
            yield _prompt(i, rng, n, max_tokens, self.token_ids)


@dataclass(frozen=True)
class SharedPrefix:
    """A few long system prompts, each shared by many short questions (SGLang's generated-shared-prefix)."""

    name = "shared-prefix"
    system_prompt_tokens: int = _param(512, "length of each shared system prompt in tokens")
    num_prefixes: int = _param(1, "number of distinct system prompts; each request picks one at random")
    question_tokens: int = _param(32, "length of each user question in tokens")
    output_tokens: int = _param(64, "max_tokens of each request")

    def __post_init__(self) -> None:
        _require(min(self.system_prompt_tokens, self.num_prefixes, self.question_tokens,
                     self.output_tokens) >= 1, "shared-prefix: every parameter must be >= 1")

    def requests(self, count: int, rng: random.Random) -> Iterator[RequestSpec]:
        prompts = [words(rng, self.system_prompt_tokens) for _ in range(self.num_prefixes)]
        for i in range(count):
            group = rng.randrange(self.num_prefixes)
            yield RequestSpec(i, self.output_tokens, messages=(
                {"role": "system", "content": prompts[group]},
                {"role": "user", "content": words(rng, self.question_tokens)}))


@dataclass(frozen=True)
class MultiTurn:
    """Conversations of several turns; each turn sends the whole history, replies included.

    NOTE: turns are ordered round robin over the conversations (every first turn, then every
    second turn...), so a conversation's next turn usually comes due after its reply; when it
    does not, the runner holds it until the reply arrives.
    """

    name = "multi-turn"
    turns: int = _param(4, "turns per conversation; count / turns conversations (rounded up)")
    turn_tokens: int = _param(64, "length of each user message in tokens")
    output_tokens: int = _param(64, "max_tokens of each reply")
    system_prompt_tokens: int = _param(0, "length of each conversation's own system prompt; 0 = none")

    def __post_init__(self) -> None:
        _require(self.turns >= 1 and self.turn_tokens >= 1 and self.output_tokens >= 1,
                 "multi-turn: turns, turn_tokens and output_tokens must be >= 1")
        _require(self.system_prompt_tokens >= 0, "multi-turn: system_prompt_tokens must be >= 0")

    def requests(self, count: int, rng: random.Random) -> Iterator[RequestSpec]:
        conversations = math.ceil(count / self.turns)
        systems = [words(rng, self.system_prompt_tokens) for _ in range(conversations)]
        index = 0
        for turn in range(self.turns):
            for conversation in range(conversations):
                if index == count:
                    return
                user = {"role": "user", "content": words(rng, self.turn_tokens)}
                first = (({"role": "system", "content": systems[conversation]},)
                         if turn == 0 and self.system_prompt_tokens else ())
                yield RequestSpec(index, self.output_tokens, messages=(*first, user),
                                  conversation=conversation, turn=turn)
                index += 1


@dataclass(frozen=True)
class LongDoc:
    """Questions over a few long documents: the document is the long shared prefix."""

    name = "long-doc"
    num_docs: int = _param(4, "number of documents; each request asks about one at random")
    doc_tokens: int = _param(2000, "length of each document in tokens")
    question_tokens: int = _param(32, "length of each question in tokens")
    output_tokens: int = _param(64, "max_tokens of each answer")

    def __post_init__(self) -> None:
        _require(min(self.num_docs, self.doc_tokens, self.question_tokens, self.output_tokens) >= 1,
                 "long-doc: every parameter must be >= 1")

    def requests(self, count: int, rng: random.Random) -> Iterator[RequestSpec]:
        docs = [words(rng, self.doc_tokens) for _ in range(self.num_docs)]
        for i in range(count):
            doc = rng.randrange(self.num_docs)
            content = f"Document:\n{docs[doc]}\n\nQuestion: {words(rng, self.question_tokens)}"
            yield RequestSpec(i, self.output_tokens, messages=({"role": "user", "content": content},))


@dataclass(frozen=True)
class Mixed:
    """Long prompts with short answers mixed with short prompts with long answers.

    The long ones load prefill, the short ones decode; the report gives each kind ("long",
    "short") its own latencies under by_kind.
    """

    name = "mixed"
    long_fraction: float = _param(0.5, "fraction of requests that are long-prompt ones")
    long_prompt_min: int = _param(1000, "long requests: smallest prompt, tokens")
    long_prompt_max: int = _param(1500, "long requests: largest prompt, tokens")
    long_max_tokens_min: int = _param(4, "long requests: smallest max_tokens")
    long_max_tokens_max: int = _param(8, "long requests: largest max_tokens")
    short_prompt_tokens: int = _param(30, "short requests: prompt length, tokens")
    short_max_tokens_min: int = _param(64, "short requests: smallest max_tokens")
    short_max_tokens_max: int = _param(128, "short requests: largest max_tokens")
    token_ids: bool = _param(False, "send token ids (exact lengths, no chat template) instead of chat text")

    def __post_init__(self) -> None:
        _require(0 <= self.long_fraction <= 1,
                 f"mixed: long_fraction must be in [0, 1], got {self.long_fraction}")
        for low, high in (("long_prompt_min", "long_prompt_max"),
                          ("long_max_tokens_min", "long_max_tokens_max"),
                          ("short_max_tokens_min", "short_max_tokens_max")):
            _require(1 <= getattr(self, low) <= getattr(self, high),
                     f"mixed: need 1 <= {low} <= {high}, got {getattr(self, low)} and {getattr(self, high)}")
        _require(self.short_prompt_tokens >= 1, "mixed: short_prompt_tokens must be >= 1")

    def requests(self, count: int, rng: random.Random) -> Iterator[RequestSpec]:
        for i in range(count):
            if rng.random() < self.long_fraction:
                n = rng.randint(self.long_prompt_min, self.long_prompt_max)
                max_tokens, kind = rng.randint(self.long_max_tokens_min, self.long_max_tokens_max), "long"
            else:
                n = self.short_prompt_tokens
                max_tokens, kind = rng.randint(self.short_max_tokens_min, self.short_max_tokens_max), "short"
            yield dataclasses.replace(_prompt(i, rng, n, max_tokens, self.token_ids), kind=kind)


def _prompt(index: int, rng: random.Random, n: int, max_tokens: int, as_token_ids: bool) -> RequestSpec:
    if as_token_ids:
        return RequestSpec(index, max_tokens, token_ids=token_ids(rng, n))
    return RequestSpec(index, max_tokens, messages=({"role": "user", "content": words(rng, n)},))


WORKLOADS: dict[str, type] = {w.name: w for w in (Synthetic, SharedPrefix, MultiTurn, LongDoc, Mixed)}


# --- building from names and strings (the CLI's --param NAME=VALUE) ------------------------------

def make_workload(name: str, params: Mapping[str, Any] | None = None) -> Workload:
    """The workload called `name` with `params` (values may be strings, as from the command line)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    cls = WORKLOADS[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in (params or {}).items():
        if key not in fields:
            raise ValueError(f"workload {name} has no parameter {key!r}; it has {', '.join(fields)}")
        values[key] = _convert(value, type(fields[key].default), key)
    return cls(**values)


def parse_params(pairs: Sequence[str]) -> dict[str, str]:
    """["a=1", "b=x"] -> {"a": "1", "b": "x"}."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--param takes NAME=VALUE, got {pair!r}")
        out[key.strip()] = value.strip()
    return out


def _convert(value: Any, kind: type, key: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return value.lower() in ("true", "1", "yes")
        return kind(value)
    except ValueError:
        expected = {int: "an integer", float: "a number", bool: "true or false"}.get(kind, kind.__name__)
        raise ValueError(f"parameter {key} takes {expected}, got {value!r}") from None


def workload_params(workload: Workload) -> dict[str, Any]:
    return dataclasses.asdict(workload)


def describe_workloads() -> str:
    """Every workload with its parameters, defaults and meaning (for --list-workloads)."""
    lines = []
    for name, cls in WORKLOADS.items():
        lines.append(f"{name}: {(cls.__doc__ or '').strip().splitlines()[0]}")
        for f in dataclasses.fields(cls):
            lines.append(f"    {f.name + '=' + repr(f.default):<28} {f.metadata['help']}")
    return "\n".join(lines)


# --- multi-turn state ---------------------------------------------------------------------------

class ConversationHistory:
    """The messages of each conversation so far, replies included; owned by one run."""

    def __init__(self) -> None:
        self._messages: dict[int, list[Message]] = {}

    def messages_for(self, spec: RequestSpec) -> list[Message]:
        """What to send for spec: its conversation's history, then the turn's new messages."""
        history = self._messages.get(spec.conversation, []) if spec.conversation is not None else []
        return [*history, *spec.messages]

    def record_reply(self, spec: RequestSpec, reply: str) -> None:
        if spec.conversation is not None:
            self._messages[spec.conversation] = [*self.messages_for(spec),
                                                 {"role": "assistant", "content": reply}]
