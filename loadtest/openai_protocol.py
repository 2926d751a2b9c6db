"""OpenAI's HTTP API as the load generator speaks it: request bodies, streamed chunks -> a Reply,
error responses -> a status. Pure: no sockets (openai_transport.py does the I/O).

Requests. Chat messages go to POST /v1/chat/completions, token-id prompts to POST /v1/completions
with `prompt` a list of ints; both with stream=true and stream_options.include_usage=true, and
max_tokens, temperature, top_p, seed and stop when set, plus the extensions vLLM and pdserve accept,
top_k and ignore_eos, only when set (a strict OpenAI server refuses fields it does not know).

Chunks. A chunk is a token message when a choice carries text (chat: delta.content, completions:
text); chat's opening chunk (role "assistant", content "") and the finishing one carry none. A
token message counts one token (OpenAI, vLLM and pdserve send one chunk per token), or
len(token_ids) when the chunk carries them (vLLM's return_token_ids).
NOTE: a token that adds no text sends no chunk: a special token, which decodes to nothing (with
ignore_eos SmolLM2 writes <|im_end|> and <|im_start|> every few dozen tokens), or one that ends
inside a UTF-8 character, which pdserve holds back until the character is whole. So when the final
usage.completion_tokens is more than the chunks counted, the difference joins the last token
message: totals, TPOT and the mean ITL are then those of the tokens generated (as over gRPC, whose
messages carry their token ids), while the gaps stay the gaps between chunks as they arrived.
The stream is OK when a choice finished (finish_reason) and `data: [DONE]` came. The final usage
chunk gives prompt, completion and cached tokens (usage.prompt_tokens_details.cached_tokens);
pdserve's own extension object, `pdserve` on the finishing chunk, gives the workers and the
router's timings when present and is never required.

Statuses of failed requests (the report's `errors` counts them):

    HTTP <code>         the server answered an error status, e.g. "HTTP 429"; the message is the
                        body's error.type and error.message, and Retry-After when given
    STREAM_ERROR        an {"error": ...} event inside a 200 stream (the status line was sent)
    INCOMPLETE_STREAM   the stream ended before a choice finished or before data: [DONE]
    BAD_RESPONSE        an event that is not JSON, or not an object
    TIMEOUT             no end of stream within the request's deadline (--timeout)
    CONNECTION_ERROR    no connection, or it broke mid-stream
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from loadtest.transport import GenerationRequest, Reply, ReplyBuilder

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
DONE = "[DONE]"
EXTENSION = "pdserve"

STREAM_ERROR = "STREAM_ERROR"
INCOMPLETE_STREAM = "INCOMPLETE_STREAM"
BAD_RESPONSE = "BAD_RESPONSE"
TIMEOUT = "TIMEOUT"
CONNECTION_ERROR = "CONNECTION_ERROR"
MAX_ERROR_CHARS = 500


def http_status(code: int) -> str:
    return f"HTTP {code}"


def request_body(request: GenerationRequest, model: str) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of request."""
    s = request.sampling
    body: dict[str, Any] = {"model": model}
    if request.token_ids:
        path, body["prompt"] = COMPLETIONS_PATH, list(request.token_ids)
    else:
        path, body["messages"] = CHAT_PATH, [dict(m) for m in request.messages]
    body.update({"max_tokens": s.max_tokens, "stream": True, "stream_options": {"include_usage": True}})
    optional = {"temperature": s.temperature, "top_p": s.top_p, "seed": s.seed,
                "stop": list(s.stop) or None, "top_k": s.top_k, "ignore_eos": s.ignore_eos or None}
    body.update({k: v for k, v in optional.items() if v is not None})
    return path, body


def error_status(code: int, body: str, retry_after: str | None = None) -> tuple[str, str]:
    """(status, message) of an error response: OpenAI's {"error": {...}} body, or its text."""
    error = _error_object(body)
    message = (f"{error.get('type') or 'error'}: {error.get('message')}" if error is not None
               else body.strip()[:MAX_ERROR_CHARS] or "(empty body)")
    if retry_after:
        message += f" (Retry-After: {retry_after})"
    return http_status(code), message


def _error_object(body: str) -> Mapping[str, Any] | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return error if isinstance(error, dict) else None


def model_ids(body: Any) -> list[str]:
    """The ids GET /v1/models lists ({"object": "list", "data": [{"id": ...}]})."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ValueError(f"GET {MODELS_PATH} did not answer OpenAI's model list: {str(body)[:200]}")
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


class StreamReader:
    """One streamed answer's events (the data of each SSE event, with its receipt time) -> a Reply."""

    def __init__(self, reply: ReplyBuilder) -> None:
        self.reply = reply
        self.done = False
        self.finish_reason: str | None = None
        self.usage: dict[str, int] | None = None
        self.extension: Mapping[str, Any] | None = None
        self.failure: tuple[str, str] | None = None  # (status, message): why the stream is not a good one

    def event(self, data: str, at: float) -> None:
        if self.failure is not None:
            return
        if data.strip() == DONE:
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict):
            self.failure = (BAD_RESPONSE, f"an event that is not a JSON object: {data[:200]!r}")
            return
        if "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
            self.failure = (STREAM_ERROR, f"{error.get('type') or 'error'}: {error.get('message')}")
            return
        for choice in chunk.get("choices") or ():
            self._choice(choice, at)
        if isinstance(chunk.get("usage"), dict):
            self.usage = usage_fields(chunk["usage"])
        if isinstance(chunk.get(EXTENSION), dict):
            self.extension = chunk[EXTENSION]

    def _choice(self, choice: Mapping[str, Any], at: float) -> None:
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        ids = choice.get("token_ids")
        count = len(ids) if isinstance(ids, list) and ids else (1 if text else 0)
        if count:
            self.reply.tokens(count, at)
        if isinstance(text, str):
            self.reply.text(text)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

    def result(self) -> Reply:
        """The Reply, once the stream has ended (or broken off: then INCOMPLETE_STREAM)."""
        final = self._final_fields()
        if self.usage is not None and "completion_tokens" in self.usage:
            self.reply.uncounted(self.usage["completion_tokens"] - sum(self.reply.counts))
        if self.failure is not None:
            return self.reply.failed(*self.failure, **final)
        if self.finish_reason is None or not self.done:
            missing = "a finished choice (finish_reason)" if self.finish_reason is None else "data: [DONE]"
            return self.reply.failed(INCOMPLETE_STREAM, f"the stream ended without {missing}", **final)
        return self.reply.finished(**final)

    def _final_fields(self) -> dict[str, Any]:
        ext = self.extension or {}
        usage = dict(self.usage) if self.usage is not None else None
        if usage is not None and isinstance(ext.get("computed_tokens"), int):
            usage["computed_tokens"] = ext["computed_tokens"]
        timings = ext.get("timings")
        return {"usage": usage, "finish_reason": self.finish_reason,
                "server_timings_ms": dict(timings) if isinstance(timings, dict) else None,
                "prefill_worker": ext.get("prefill_worker") or None,
                "decode_worker": ext.get("decode_worker") or None}


def usage_fields(usage: Mapping[str, Any]) -> dict[str, int]:
    """OpenAI's usage -> the record's: prompt, completion and (when the server says) cached tokens."""
    out = {k: usage[k] for k in ("prompt_tokens", "completion_tokens") if isinstance(usage.get(k), int)}
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        out["cached_tokens"] = details["cached_tokens"]
    return out
