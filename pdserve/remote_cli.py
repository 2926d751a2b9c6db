"""`pdserve generate --router` and `pdserve chat`: the CLI over the router's gRPC API.

Text streams to stdout as it arrives. A failed request prints `STATUS: message` to
stderr and exits 1; an unreachable router says so and names the address. Nothing here
imports torch: the model lives behind the router.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from pdserve.client import DEFAULT_TIMEOUT_S, Completion, PdserveClient, PdserveError, RouterUnreachable
from pdserve.client_security import client_kwargs, security_from_args
from pdserve.jsonl_input import lines_of, object_of_line

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop", "stop_token_ids",
                 "ignore_eos")
PROMPT_KEYS = ("prompt", "messages", "token_ids")
JSONL_KEYS = (*PROMPT_KEYS, "raw", "request_id", *SAMPLING_KEYS)
EXIT_INTERRUPTED = 130


# --- generate -----------------------------------------------------------------------------------

def run_remote_generate(args: argparse.Namespace) -> int:
    _reject_local_only_flags(args)
    if args.input and (args.prompt is not None or args.token_ids):
        raise ValueError("--input reads the prompts from the file; drop PROMPT / --token-ids")
    sampling = sampling_kwargs(args)
    prompt = None if args.input else prompt_kwargs(args)
    timeout_s = getattr(args, "timeout", DEFAULT_TIMEOUT_S)
    with PdserveClient(args.router, timeout_s=timeout_s, **client_kwargs(security_from_args(args))) as client:
        try:
            if args.input:
                return _run_jsonl(client, args.input, args, sampling)
            return _run_one(client, {**prompt, **sampling}, as_json=args.json)
        except PdserveError as exc:
            print(exc, file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return EXIT_INTERRUPTED


def _reject_local_only_flags(args: argparse.Namespace) -> None:
    for flag, value in (("--model", args.model), ("--num-blocks", args.num_blocks)):
        if value is not None:
            raise ValueError(f"{flag} applies to --local only; the router serves its own model "
                             f"and cache (drop {flag}, or use --local)")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags that were given (None means: the router's default)."""
    given = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
             "seed": args.seed, "max_tokens": args.max_tokens, "stop": args.stop or None}
    return {k: v for k, v in given.items() if v is not None}


def prompt_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """PROMPT, --token-ids, --raw and --system as request_from keywords."""
    if args.token_ids and args.prompt is not None:
        raise ValueError("give PROMPT or --token-ids, not both")
    if args.token_ids:
        return {"token_ids": parse_token_ids(args.token_ids)}
    if args.prompt is None:
        raise ValueError("no prompt: give PROMPT, --token-ids 1,2,3, or --input FILE.jsonl")
    return text_prompt(args.prompt, raw=args.raw, system=args.system)


def text_prompt(text: str, *, raw: bool, system: str | None) -> dict[str, Any]:
    if raw and system:
        raise ValueError("--system needs the chat template, which --raw skips; drop one of them")
    if system:
        return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": text}]}
    return {"prompt": text, "raw": raw}


def parse_token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--token-ids must be comma-separated integers, got {text!r}") from None


def _run_one(client: PdserveClient, request: dict[str, Any], *, as_json: bool) -> int:
    if as_json:
        print(json.dumps(client.generate(**request).as_json()), flush=True)
        return 0
    stream_reply(client, request, sys.stdout)
    return 0


def stream_reply(client: PdserveClient, request: dict[str, Any], out: TextIO) -> Completion:
    """Print the text as it arrives, then a newline; cancels the call if interrupted."""
    with client.stream(**request) as stream:
        try:
            for delta in stream.deltas():
                print(delta.text, end="", file=out, flush=True)
        finally:
            print(file=out, flush=True)
        return stream.result()


def _run_jsonl(client: PdserveClient, path: str, args: argparse.Namespace,
               sampling: dict[str, Any]) -> int:
    """One JSON result (or {"error", "code", "line"}) per input line; exit 1 if any failed."""
    failures = 0
    for lineno, line in lines_of(path):
        try:
            request = {**sampling, **request_from_json_line(line, lineno, args)}
            print(json.dumps(client.generate(**request).as_json()), flush=True)
        except RouterUnreachable:
            raise  # every further line would fail the same way
        except PdserveError as exc:
            failures += 1
            print(json.dumps({"error": str(exc), "code": exc.code, "line": lineno}), flush=True)
        except (ValueError, TypeError) as exc:  # TypeError: a field of the wrong JSON type
            failures += 1
            print(json.dumps({"error": str(exc), "code": "INVALID_ARGUMENT", "line": lineno}), flush=True)
    return 1 if failures else 0


def request_from_json_line(line: str, lineno: int, args: argparse.Namespace) -> dict[str, Any]:
    obj = object_of_line(line, lineno)
    unknown = sorted(set(obj) - set(JSONL_KEYS))
    if unknown:
        raise ValueError(f"--input line {lineno}: unknown field(s) {', '.join(unknown)}; "
                         f"expected some of {', '.join(JSONL_KEYS)}")
    request = dict(obj)
    if "prompt" in request and "raw" not in request:
        request["raw"] = args.raw
    if isinstance(request.get("prompt"), str):
        text = request.pop("prompt")
        request.update(text_prompt(text, raw=request.pop("raw"), system=args.system))
    return request


# --- chat ---------------------------------------------------------------------------------------

def run_chat(args: argparse.Namespace) -> int:
    secure = client_kwargs(security_from_args(args))
    with PdserveClient(args.router, timeout_s=args.timeout, **secure) as client:
        return ChatSession(client, args.system, sampling_kwargs(args)).run()


class ChatSession:
    """A multi-turn chat: the whole history goes with every turn, so the router can reuse
    the KV cache of everything said so far."""

    PROMPT = "you> "
    COMMANDS = "/reset clears the history, /exit quits"

    def __init__(self, client: PdserveClient, system: str | None, sampling: dict[str, Any],
                 out: TextIO | None = None, err: TextIO | None = None):
        self.client, self.system, self.sampling = client, system, sampling
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.history: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []
        self.turn = 1

    def run(self) -> int:
        print(f"pdserve chat with {self.client.target} ({self.COMMANDS})", file=self.err)
        while True:
            try:
                line = input(self.PROMPT)
            except EOFError:
                print(file=self.out)
                return 0
            except KeyboardInterrupt:
                print(file=self.out)
                return EXIT_INTERRUPTED
            if not sys.stdin.isatty():
                print(line, file=self.out)  # a terminal echoes what was typed; a pipe does not
            status = self.handle(line.strip())
            if status is not None:
                return status

    def handle(self, line: str) -> int | None:
        """Act on one input line; an int means: quit with this exit code."""
        if not line:
            return None
        if line == "/exit":
            return 0
        if line == "/reset":
            self.reset()
            print("(history cleared)", file=self.err)
            return None
        if line.startswith("/"):
            print(f"unknown command {line.split()[0]}; {self.COMMANDS}", file=self.err)
            return None
        return self.ask(line)

    def ask(self, text: str) -> int | None:
        messages = [*self.history, {"role": "user", "content": text}]
        try:
            completion = stream_reply(self.client, {"messages": messages, **self.sampling}, self.out)
        except RouterUnreachable as exc:
            print(exc, file=self.err)
            return 1
        except PdserveError as exc:
            print(f"{exc} (this turn was not added to the history)", file=self.err)
            return None
        except KeyboardInterrupt:
            print("(cancelled; this turn was not added to the history)", file=self.err)
            return None
        self.history = [*messages, {"role": "assistant", "content": completion.text}]
        print(self._dim(stats_line(self.turn, completion)), file=self.err, flush=True)
        self.turn += 1
        return None

    def _dim(self, text: str) -> str:
        return f"\x1b[2m{text}\x1b[0m" if self.err.isatty() else text


def stats_line(turn: int, c: Completion) -> str:
    """E.g. [turn 2: 143 prompt tokens, 128 cached, 15 computed, 41 generated · ttft 85 ms · ...]."""
    u = c.usage
    workers = (f"decode worker {c.decode_worker}" if c.prefill_worker is None
               else f"prefill worker {c.prefill_worker} → decode worker {c.decode_worker}")
    return (f"[turn {turn}: {u['prompt_tokens']} prompt tokens, {u['cached_tokens']} cached, "
            f"{u['computed_tokens']} computed, {u['completion_tokens']} generated · "
            f"ttft {c.timings['ttft_ms']:.0f} ms · {workers}]")
