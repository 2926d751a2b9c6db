"""`pdserve generate --local` and the in-process `pdserve up`: the engine driven from a shell.

Prompts go through the model's chat template unless --raw; --token-ids skips
tokenising. A sampling flag not given takes the model's default (LoadedModel.sampling_defaults),
as a request through the router does. --input FILE.jsonl runs one request per line, in order, in one
engine, so the prefix cache carries over from line to line.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import InvalidRequestError, LLMEngine, RequestResult
from pdserve.engine.sampling_defaults import NEUTRAL, SamplingDefaults
from pdserve.engine.sequence import SamplingParams
from pdserve.jsonl_input import lines_of, object_of_line


@dataclass(frozen=True)
class PromptSpec:
    """One request as the user gave it: exactly one of text, messages or token_ids."""

    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    token_ids: tuple[int, ...] | None = None
    raw: bool = False
    system: str | None = None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    cache = CacheConfig(block_size=args.block_size, kv_dtype=args.kv_dtype, num_blocks=args.num_blocks)
    scheduler = SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens)
    return EngineConfig(model_path=args.model, cache=cache, scheduler=scheduler)


def sampling_from(args: argparse.Namespace, defaults: SamplingDefaults,
                  overrides: dict[str, Any] | None = None) -> SamplingParams:
    """A JSONL line's fields over the flags over the model's defaults (a flag not given is None)."""
    o = overrides or {}

    def chosen(name: str) -> Any:
        flag = getattr(args, name)
        return o.get(name, getattr(defaults, name) if flag is None else flag)

    return SamplingParams(
        temperature=float(chosen("temperature")),
        top_k=int(chosen("top_k")),
        top_p=float(chosen("top_p")),
        seed=o.get("seed", args.seed),
        max_tokens=int(o.get("max_tokens", args.max_tokens)),
        stop=tuple(o.get("stop", args.stop or ())),
    )


def prompt_ids(engine: LLMEngine, spec: PromptSpec) -> list[int]:
    if spec.token_ids is not None:
        return list(spec.token_ids)
    tok = engine.tokenizer
    if spec.messages is not None:
        return tok.apply_chat_template(list(spec.messages), add_generation_prompt=True)
    if spec.text is None:
        raise InvalidRequestError("no prompt: give PROMPT, --token-ids, or --input FILE.jsonl")
    if spec.raw:
        return tok.encode(spec.text)
    messages = ([{"role": "system", "content": spec.system}] if spec.system else [])
    return tok.apply_chat_template(messages + [{"role": "user", "content": spec.text}],
                                   add_generation_prompt=True)


def parse_token_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise InvalidRequestError(f"--token-ids must be comma-separated integers, got {text!r}") from None


def stream(engine: LLMEngine, ids: list[int],
           sampling: SamplingParams) -> Iterator[tuple[str, RequestResult]]:
    """Yield (text delta, result so far) after each step that produced a token."""
    request_id = engine.add_request(ids, sampling)
    result = RequestResult(request_id)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            result.token_ids += out.new_token_ids
            result.text += out.text_delta
            result.finish_reason, result.usage = out.finish_reason, out.usage
            yield out.text_delta, result


def run_one(engine: LLMEngine, spec: PromptSpec, sampling: SamplingParams, echo: bool) -> RequestResult:
    result = RequestResult("")
    for delta, latest in stream(engine, prompt_ids(engine, spec), sampling):
        result = latest
        if echo and delta:
            print(delta, end="", flush=True)
    if echo:
        print()
    return result


def result_json(result: RequestResult) -> str:
    return json.dumps({"text": result.text, "token_ids": result.token_ids,
                       "finish_reason": result.finish_reason, "usage": result.usage.as_dict()})


def spec_from_json_line(line: str, lineno: int, args: argparse.Namespace) -> tuple[PromptSpec, dict]:
    obj = object_of_line(line, lineno)
    messages = obj.get("messages")
    token_ids = obj.get("token_ids")
    spec = PromptSpec(text=obj.get("prompt"), raw=bool(obj.get("raw", args.raw)), system=args.system,
                      messages=tuple(messages) if messages is not None else None,
                      token_ids=tuple(token_ids) if token_ids is not None else None)
    return spec, obj


def run_jsonl(engine: LLMEngine, path: str, args: argparse.Namespace) -> int:
    failures = 0
    for lineno, line in lines_of(path):
        try:
            spec, obj = spec_from_json_line(line, lineno, args)
            sampling = sampling_from(args, engine.sampling_defaults, obj)
            print(result_json(run_one(engine, spec, sampling, echo=False)), flush=True)
        except (InvalidRequestError, ValueError) as e:
            failures += 1
            print(json.dumps({"error": str(e), "line": lineno}), flush=True)
    return 1 if failures else 0


def load_engine(args: argparse.Namespace) -> LLMEngine:
    return LLMEngine.from_config(engine_config_from_args(args), progress=not args.no_progress)


def run_generate(args: argparse.Namespace) -> int:
    sampling_from(args, NEUTRAL)  # bad flags fail before the model loads
    token_ids = parse_token_ids(args.token_ids) if args.token_ids else None
    if not args.input and args.prompt is None and token_ids is None:
        raise InvalidRequestError("no prompt: give PROMPT, --token-ids 1,2,3, or --input FILE.jsonl")
    engine = load_engine(args)
    if args.input:
        return run_jsonl(engine, args.input, args)
    spec = PromptSpec(text=args.prompt, token_ids=token_ids, raw=args.raw, system=args.system)
    result = run_one(engine, spec, sampling_from(args, engine.sampling_defaults), echo=not args.json)
    if args.json:
        print(result_json(result))
    return 0
