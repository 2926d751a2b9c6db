"""GenerateResponse messages -> OpenAI's JSON: whole answers and streamed chunks.

Pure: no aiohttp. One AnswerBuilder per request turns the servicer's replies into

    streaming, chat         {"delta": {"role": "assistant", "content": ""}}     first chunk
                            {"delta": {"content": "..."}, "logprobs": ...}      one per reply with text
                            {"delta": {}, "finish_reason": "stop"|"length"}     last choice chunk, with
                                                                                 the "pdserve" extension
                            {"choices": [], "usage": {...}}                      with include_usage
    streaming, completion   the same without the role chunk, "text" instead of "delta"
    whole                   chat.completion / text_completion with usage and the extension

Text deltas come from the decode worker already whole: it holds back a token that ends inside a
UTF-8 character until the character is complete (pdserve/engine/llm_engine.py _update_text).

The "pdserve" object carries what OpenAI's shapes have no place for (the workers that served the
request, computed tokens, the router's timings, each move of the stream to another decode worker);
standard clients ignore it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from pdserve.engine.tokenizer import Tokenizer
from protos.pdserve.v1 import generation_pb2 as pb
from router.http.protocol import ApiRequest

EXTENSION = "pdserve"


def usage_json(u: pb.Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def extension_json(last: pb.GenerateResponse) -> dict:
    t = last.timings
    return {"request_id": last.request_id, "prefill_worker": last.prefill_worker,
            "decode_worker": last.decode_worker, "computed_tokens": last.usage.computed_tokens,
            "timings": {"queue_ms": t.queue_ms, "prefill_ms": t.prefill_ms, "transfer_ms": t.transfer_ms,
                        "ttft_ms": t.ttft_ms},
            "migrations": [migration_json(m) for m in last.migrations]}


def migration_json(m: pb.Migration) -> dict:
    return {"cause": m.cause, "from_decode_worker": m.from_decode_worker,
            "to_decode_worker": m.to_decode_worker, "after_tokens": m.after_tokens,
            "replayed_tokens": m.replayed_tokens,
            "cached_tokens": m.cached_tokens, "gap_ms": m.gap_ms}


@dataclass
class AnswerBuilder:
    request: ApiRequest
    tokenizer: Tokenizer
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    last: pb.GenerateResponse | None = None
    streamed_token_chars: int = 0  # completions' text_offset of the next streamed logprob entry

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl" if self.is_chat else "cmpl"
            self.id = f"{prefix}-{uuid.uuid4().hex}"

    @property
    def is_chat(self) -> bool:
        return self.request.kind == "chat"

    # --- streaming -------------------------------------------------------------------------------
    def opening_chunks(self) -> list[dict]:
        return [self._chunk({"delta": {"role": "assistant", "content": ""}})] if self.is_chat else []

    def chunks(self, reply: pb.GenerateResponse) -> list[dict]:
        """The chunks one servicer reply makes: its text (if any), then the finish when it is the last."""
        self.add(reply)
        out = []
        if reply.text or self._wants_logprobs(reply) or (self.request.return_token_ids and reply.token_ids):
            logprobs = self._logprobs_json(reply.logprobs, self.streamed_token_chars)
            if logprobs is not None and not self.is_chat:
                self.streamed_token_chars += sum(len(t) for t in logprobs["tokens"])
            out.append(self._chunk({**self._text_field(reply.text), "logprobs": logprobs,
                                    **self._token_ids(reply.token_ids)}))
        if reply.finished:
            out.append(self._chunk({**self._text_field(None), "logprobs": None,
                                    "finish_reason": self.finish_reason}, extension=True))
            if self.request.include_usage:
                out.append(self._usage_chunk())
        return out

    def _text_field(self, text: str | None) -> dict:
        if self.is_chat:
            return {"delta": {"content": text} if text is not None else {}}
        return {"text": text or ""}

    def _chunk(self, choice: dict, extension: bool = False) -> dict:
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.is_chat else "text_completion",
                 "created": self.created, "model": self.request.model,
                 "choices": [{"index": 0, "finish_reason": None, **choice}]}
        if self.request.include_usage:
            chunk["usage"] = None
        if extension and self.last is not None:
            chunk[EXTENSION] = extension_json(self.last)
        return chunk

    def _usage_chunk(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.is_chat else "text_completion",
                "created": self.created, "model": self.request.model, "choices": [],
                "usage": usage_json(self.last.usage)}

    # --- whole answers --------------------------------------------------------------------------
    def add(self, reply: pb.GenerateResponse) -> None:
        self.text.append(reply.text)
        self.logprobs.extend(reply.logprobs)
        self.token_ids.extend(reply.token_ids)
        if reply.finished:
            self.finish_reason, self.last = reply.finish_reason or "stop", reply

    def answer(self) -> dict:
        text = "".join(self.text)
        if self.is_chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self._logprobs_json(self.logprobs), "finish_reason": self.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": self._logprobs_json(self.logprobs),
                      "finish_reason": self.finish_reason}
        choice.update(self._token_ids(self.token_ids))
        last = self.last or pb.GenerateResponse()
        return {"id": self.id, "object": "chat.completion" if self.is_chat else "text_completion",
                "created": self.created, "model": self.request.model, "choices": [choice],
                "usage": usage_json(last.usage), EXTENSION: extension_json(last)}

    def _token_ids(self, ids) -> dict:
        return {"token_ids": list(ids)} if self.request.return_token_ids else {}

    # --- logprobs ----------------------------------------------------------------------------
    def _wants_logprobs(self, reply: pb.GenerateResponse) -> bool:
        return self.request.logprobs is not None and len(reply.logprobs) > 0

    def _logprobs_json(self, entries, text_offset: int = 0) -> dict | None:
        if self.request.logprobs is None:
            return None
        if self.is_chat:
            return {"content": [self._chat_entry(e) for e in entries]}
        return self._completion_entries(entries, text_offset)

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _chat_entry(self, e: pb.TokenLogprob) -> dict:
        token, raw = self._token(e.token_id)
        top = []
        for alt in e.top:
            alt_token, alt_raw = self._token(alt.token_id)
            top.append({"token": alt_token, "logprob": alt.logprob, "bytes": alt_raw})
        return {"token": token, "logprob": e.logprob, "bytes": raw, "top_logprobs": top}

    def _completion_entries(self, entries, offset: int) -> dict:
        """The legacy completions form; text_offset counts the tokens' own characters."""
        tokens, offsets = [], []
        for e in entries:
            token, _ = self._token(e.token_id)
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._token(a.token_id)[0]: a.logprob for a in e.top} for e in entries],
                "text_offset": offsets}
