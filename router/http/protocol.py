"""OpenAI request bodies -> the router's GenerateRequest, checked field by field.

Pure: no sockets, no aiohttp, no gRPC calls. Each parse_* takes the decoded JSON body and returns
an ApiRequest, or raises ApiError (400) naming the field as the client wrote it. Only the shape
is checked here (types, OpenAI's fixed choices such as n = 1); the limits that gRPC also applies
(max_tokens, context, stop lists, logprobs: router/limits.py) are checked once, by the same
servicer both front doors call, and come back as INVALID_ARGUMENT (router/http/errors.py maps
them to 400).

    chat:        model, messages (string content or a list of text parts), max_tokens |
                 max_completion_tokens, temperature, top_p, seed, stop, stream, stream_options,
                 logprobs (bool) + top_logprobs, n (1 only), user; extensions (as vLLM's): top_k,
                 ignore_eos, return_token_ids (each choice, or chunk, also carries its token ids),
                 chat_template_kwargs (an object of extra chat-template variables, e.g.
                 {"enable_thinking": false} for Qwen3's template)
    completions: model, prompt (string or token ids), the same sampling fields, echo (false
                 only), logprobs (an integer: that many alternatives)

Fields OpenAI defines that change the answer and pdserve does not implement (tools,
response_format, presence_penalty != 0, ...) are a 400 naming the field, never silently ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.roles import CHAT_ROLES
from protos.pdserve.v1 import generation_pb2 as pb
from router.http.errors import ApiError

# OpenAI fields that would change the output and have no pdserve meaning: refused, not ignored.
_UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias",
                "suffix", "audio", "modalities", "prediction")
# Penalties are accepted at their neutral value only.
_NEUTRAL_ZERO = ("presence_penalty", "frequency_penalty")
# Accepted and not used: they change nothing about the tokens.
_IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
_COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n",
           "top_k", "ignore_eos", "return_token_ids", "best_of", *_NEUTRAL_ZERO, *_IGNORED, *_UNSUPPORTED)
CHAT_FIELDS = frozenset((*_COMMON, "messages", "max_completion_tokens", "logprobs", "top_logprobs",
                         "chat_template_kwargs"))
COMPLETION_FIELDS = frozenset((*_COMMON, "prompt", "echo", "logprobs"))


@dataclass(frozen=True)
class ApiRequest:
    """One parsed request: what to send to the Generation servicer, and how to answer."""

    kind: str  # "chat" | "completion"
    model: str
    generate: pb.GenerateRequest
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's and k alternatives
    return_token_ids: bool = False


def parse_chat(body: Any, model: str) -> ApiRequest:
    body = _object(body)
    _check_common(body, CHAT_FIELDS, model)
    chat = pb.ChatMessages(messages=_messages(body), chat_template_kwargs=_template_kwargs(body))
    request = pb.GenerateRequest(chat=chat)
    logprobs = _chat_logprobs(body)
    _fill_sampling(request.sampling, body, _max_tokens(body, "max_completion_tokens", "max_tokens"), logprobs)
    stream, include_usage = _stream(body)
    return ApiRequest("chat", model, request, stream, include_usage, logprobs,
                      _flag(body, "return_token_ids"))


def parse_completion(body: Any, model: str) -> ApiRequest:
    body = _object(body)
    _check_common(body, COMPLETION_FIELDS, model)
    if body.get("echo") not in (None, False):
        raise ApiError.invalid("echo must be false: pdserve does not return the prompt's own tokens", "echo")
    request = _completion_prompt(body)
    logprobs = _optional_int(body, "logprobs", minimum=0)
    _fill_sampling(request.sampling, body, _max_tokens(body, "max_tokens"), logprobs)
    stream, include_usage = _stream(body)
    return ApiRequest("completion", model, request, stream, include_usage, logprobs,
                      _flag(body, "return_token_ids"))


# --- the fields every endpoint shares --------------------------------------------------------------

def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise ApiError.invalid("the request body must be a JSON object", None)
    return body


def _check_common(body: Mapping[str, Any], allowed: frozenset[str], model: str) -> None:
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise ApiError.invalid(f"unknown field {unknown[0]!r}; this endpoint takes: "
                               f"{', '.join(sorted(allowed - set(_UNSUPPORTED)))}", unknown[0])
    for name in _UNSUPPORTED:
        if body.get(name) is not None:
            raise ApiError.invalid(f"{name} is not supported by pdserve; remove it", name)
    for name in _NEUTRAL_ZERO:
        if body.get(name) not in (None, 0, 0.0):
            raise ApiError.invalid(f"{name} must be 0 (pdserve has no penalties), got {body[name]!r}", name)
    for name in ("n", "best_of"):
        if body.get(name) not in (None, 1):
            raise ApiError.invalid(f"{name} must be 1: pdserve returns one choice per request; send "
                                   f"{name} requests instead, got {body[name]!r}", name)
    if "model" not in body:
        raise ApiError.invalid(f"model is required; this server serves {model!r}", "model")
    if body["model"] != model:
        raise ApiError.model_not_found(body["model"], model)


def _messages(body: Mapping[str, Any]) -> list[pb.ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError.invalid("messages must be a non-empty list of {role, content} objects", "messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(m: Any, i: int) -> pb.ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ApiError.invalid(f"{where} must be an object with role and content", where)
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise ApiError.invalid(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                               f"{where}.role")
    return pb.ChatMessage(role=role, content=_content(m.get("content"), f"{where}.content"))


def _template_kwargs(body: Mapping[str, Any]) -> str:
    """chat_template_kwargs as the JSON text GenerateRequest carries ("" = none); the router's servicer
    refuses the variables the renderer sets itself (messages, add_generation_prompt, ...)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return ""
    if not isinstance(kwargs, dict):
        raise ApiError.invalid("chat_template_kwargs must be an object of chat-template variables, e.g. "
                               f"{{\"enable_thinking\": false}}, got {kwargs!r}", "chat_template_kwargs")
    return json.dumps(kwargs) if kwargs else ""


def _content(content: Any, where: str) -> str:
    """A string, or OpenAI's list of content parts, of which pdserve takes the text ones."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise ApiError.invalid(f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError.invalid(f"{where}[{j}] must be {{\"type\": \"text\", \"text\": ...}}; this model "
                                   f"reads text only, got a part of type {kind!r}", f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _completion_prompt(body: Mapping[str, Any]) -> pb.GenerateRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return pb.GenerateRequest(text=prompt, raw=True)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if any(t < 0 for t in prompt):
            raise ApiError.invalid("prompt token ids must be >= 0", "prompt")
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt))
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise ApiError.invalid("prompt must be one string or one list of token ids; send a batch of prompts "
                               "as separate requests", "prompt")
    raise ApiError.invalid("prompt must be a non-empty string or a non-empty list of token ids", "prompt")


def _max_tokens(body: Mapping[str, Any], *names: str) -> int | None:
    """The first of names that is set (chat: max_completion_tokens before the older max_tokens)."""
    for name in names:
        value = _optional_int(body, name, minimum=1)
        if value is not None:
            return value
    return None


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    wanted = body.get("logprobs")
    if wanted not in (None, True, False):
        raise ApiError.invalid(f"logprobs must be true or false, got {wanted!r}", "logprobs")
    top = _optional_int(body, "top_logprobs", minimum=0)
    if top is not None and not wanted:
        raise ApiError.invalid("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def _fill_sampling(s: pb.SamplingParams, body: Mapping[str, Any], max_tokens: int | None,
                   logprobs: int | None) -> None:
    if max_tokens is not None:
        s.max_tokens = max_tokens
    for name in ("temperature", "top_p"):
        value = _optional_number(body, name)
        if value is not None:
            setattr(s, name, value)
    top_k = _optional_int(body, "top_k", minimum=-1)
    if top_k is not None:
        s.top_k = max(top_k, 0)  # vLLM's -1 and 0 both mean off
    seed = _optional_int(body, "seed", minimum=0, maximum=2**64 - 1)
    if seed is not None:
        s.seed = seed
    s.stop.extend(_stop(body))
    s.ignore_eos = _flag(body, "ignore_eos")
    if logprobs is not None:
        s.logprobs = logprobs


def _stop(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
        raise ApiError.invalid("stop must be a non-empty string or a list of non-empty strings", "stop")
    return stop


def _stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise ApiError.invalid(f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not stream:
        raise ApiError.invalid("stream_options needs stream: true", "stream_options")
    if not isinstance(options, dict) or options.get("include_usage") not in (None, True, False):
        raise ApiError.invalid("stream_options must be {\"include_usage\": true|false}", "stream_options")
    return True, bool(options.get("include_usage"))


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError.invalid(f"{name} must be true or false, got {value!r}", name)
    return bool(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_int(body: Mapping[str, Any], name: str, minimum: int, maximum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    bound = f" and <= {maximum}" if maximum is not None else ""
    if not _is_int(value) or value < minimum or (maximum is not None and value > maximum):
        raise ApiError.invalid(f"{name} must be an integer >= {minimum}{bound}, got {value!r}", name)
    return value


def _optional_number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ApiError.invalid(f"{name} must be a finite number >= 0, got {value!r}", name)
    return float(value)
