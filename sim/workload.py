"""Arrivals for the simulator: the load tester's own workloads and arrival times, or a trace file.

A SimRequest is a prompt of token ids, the reply it will generate (its own ids, so a later turn
that carries the reply can hit the cache), when it is due, and which earlier request's reply it
waits for (multi-turn: the load tester sends turn k+1 only after turn k's reply).

Chat prompts become ids the way SmolLM2's ChatML template lays them out, word for word (each
loadtest WORDS entry is one token for SmolLM2: tests/loadtest/test_workloads.py):

    [<|im_start|> role \\n] content [<|im_end|> \\n]  per message,   [<|im_start|> assistant \\n] after
    and, when no system message is given, the template's default system prompt (about 20 tokens).

Trace file: CSV with a header, or JSON lines, with arrival_s, prompt_tokens, output_tokens and
optional prefix_id and prefix_tokens: requests with the same prefix_id share their first
prefix_tokens tokens (default: the shortest prompt of that group, all but its last token).
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loadtest.arrivals import Bounds, scheduled_offsets
from loadtest.workloads import WORDS, RequestSpec, Workload

WORD_ID = {w: 1000 + i for i, w in enumerate(WORDS)}
ROLE_ID = {"system": 10, "user": 11, "assistant": 12}
IM_START, IM_END, NEWLINE = 1, 2, 3
DEFAULT_SYSTEM = tuple(range(100, 115))  # the template's default system prompt, 15 content tokens
REPLY_BASE = 200_000  # generated token ids start here, distinct from prompts'


@dataclass(frozen=True)
class SimRequest:
    index: int
    arrival_s: float
    prompt: tuple[int, ...]
    reply: tuple[int, ...]  # the tokens it generates; len = output tokens
    after: int | None = None  # index of the request whose reply must arrive first
    kind: str = ""
    conversation: int | None = None
    turn: int = 0


def reply_tokens(index: int, n: int) -> tuple[int, ...]:
    return tuple(REPLY_BASE + (index * 7919 + j) % 500_000 for j in range(n))


def _message(role: str, content: tuple[int, ...]) -> tuple[int, ...]:
    return (IM_START, ROLE_ID[role], NEWLINE, *content, IM_END, NEWLINE)


def _content(text: str) -> tuple[int, ...]:
    return tuple(WORD_ID.get(w, 999) for w in text.split())


def from_workload(workload: Workload, count: int, rate: float, seed: int) -> list[SimRequest]:
    """The requests `pdserve loadtest --workload W --requests count --rate rate --seed seed` sends."""
    specs = list(workload.requests(count, random.Random(seed)))
    offsets = scheduled_offsets(rate, random.Random(f"{seed}/arrivals"), Bounds(count))
    history: dict[int, tuple[tuple[int, ...], int]] = {}  # conversation -> (rendered so far, last index)
    out = []
    for spec, t in zip(specs, offsets):
        reply = reply_tokens(spec.index, spec.max_tokens)
        before, after = history.get(spec.conversation, ((), None)) if spec.conversation is not None \
            else ((), None)
        rendered = (*before, *_render(spec, first=not before))
        if spec.conversation is not None:
            history[spec.conversation] = ((*rendered, *_message("assistant", reply)), spec.index)
        out.append(SimRequest(spec.index, t, (*rendered, *GENERATION), reply, after, spec.kind,
                              spec.conversation, spec.turn))
    return out


GENERATION = (IM_START, ROLE_ID["assistant"], NEWLINE)  # the template's generation prompt


def _render(spec: RequestSpec, first: bool) -> tuple[int, ...]:
    """The spec's new messages; a conversation's first turn gets the default system prompt
    when it brings none (the template adds it to every prompt without one)."""
    if spec.token_ids:
        return tuple(spec.token_ids)
    body = tuple(t for m in spec.messages for t in _message(m["role"], _content(m["content"])))
    has_system = any(m["role"] == "system" for m in spec.messages)
    return (*(_message("system", DEFAULT_SYSTEM) if first and not has_system else ()), *body)


def from_trace(path: str | Path, seed: int = 0) -> list[SimRequest]:
    """Requests from a trace file (see the module docstring); ValueError names a bad row."""
    rows = list(_trace_rows(Path(path)))
    if not rows:
        raise ValueError(f"trace {path} has no requests")
    rng = random.Random(seed)
    groups: dict[str, int] = {}
    for r in rows:
        if r.get("prefix_id") not in (None, ""):
            pid = str(r["prefix_id"])
            given = r.get("prefix_tokens") not in (None, "")
            n = int(r["prefix_tokens"]) if given else int(r["prompt_tokens"]) - 1
            groups[pid] = min(groups.get(pid, n), n)
    prefixes = {pid: tuple(random.Random(f"{seed}/prefix/{pid}").randrange(1000, 30000) for _ in range(n))
                for pid, n in groups.items()}
    out = []
    for i, r in enumerate(sorted(rows, key=lambda r: float(r["arrival_s"]))):
        n_prompt, n_out = int(r["prompt_tokens"]), int(r["output_tokens"])
        if n_prompt < 1 or n_out < 1:
            raise ValueError(f"trace {path} row {i + 1}: prompt_tokens and output_tokens must be >= 1")
        shared = prefixes.get(str(r.get("prefix_id") or ""), ())[:n_prompt]
        own = tuple(rng.randrange(30000, 60000) for _ in range(n_prompt - len(shared)))
        out.append(SimRequest(i, float(r["arrival_s"]), (*shared, *own), reply_tokens(i, n_out)))
    return out


def _trace_rows(path: Path) -> Iterator[dict]:
    if not path.exists():
        raise FileNotFoundError(f"trace file {path} not found")
    with path.open() as f:
        first = f.readline()
        f.seek(0)
        if first.lstrip().startswith("{"):
            yield from (json.loads(line) for line in f if line.strip())
        else:
            yield from csv.DictReader(f)
