"""The engine: requests in, tokens out, one step at a time.

    add_request -> validate -> Sequence (WAITING)
    step():  scheduler.schedule -> model_runner.run -> scheduler.after_step
             -> sample -> detokenize / stop checks -> finished sequences release
             their blocks -> KV events drained to the publisher
    abort(request_id): blocks released at once, wherever the request is.

Validation happens before anything is queued, so a bad request raises
InvalidRequestError and the engine keeps serving the others.
"""

from __future__ import annotations

import itertools
import os
import uuid
from dataclasses import dataclass, field

import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import EngineConfig
from pdserve.engine.events import KVEventPublisher, NullPublisher
from pdserve.engine.hashing import cache_salt
from pdserve.engine.model import LayerDoneCallback, LlamaModel
from pdserve.engine.model_runner import ModelRunner, allocate_kv_cache
from pdserve.engine.sampler import sample
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import SamplingParams, Sequence, SequenceStatus, Usage
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.weights import LoadedModel, load_model


class InvalidRequestError(ValueError):
    """The request is malformed or cannot fit; the message names the field and the limit."""


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    usage: Usage


@dataclass
class RequestResult:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)


def select_device(requested: str | None) -> torch.device:
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig,
                 publisher: KVEventPublisher | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_config = loaded.config
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.fingerprint = loaded.fingerprint
        self.device = select_device(config.device)
        self.model = LlamaModel(loaded.config, loaded.state_dict, self.device)
        cache = config.cache
        self.block_size = cache.block_size
        num_blocks = cache.resolve_num_blocks(loaded.config)
        self.salt = cache_salt(loaded.fingerprint, cache.block_size, cache.kv_dtype)
        self.pool = BlockPool(num_blocks, cache.block_size)
        self.kv_cache = allocate_kv_cache(self.model, num_blocks, cache.block_size, cache.kv_dtype)
        self.runner = ModelRunner(self.model, self.kv_cache, cache.block_size)
        self.scheduler = Scheduler(config.scheduler, self.pool, self.salt, cache.enable_prefix_caching)
        self.publisher = publisher or NullPublisher()
        self.max_model_len = min(loaded.config.max_position_embeddings, num_blocks * cache.block_size)
        self._sequences: dict[str, Sequence] = {}
        self._detokenize: dict[str, bool] = {}
        self._arrivals = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = True,
                    publisher: KVEventPublisher | None = None) -> LLMEngine:
        return cls(load_model(config.model_path, progress=progress), config, publisher)

    # --- requests ---------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams,
                    request_id: str | None = None, detokenize: bool = True) -> str:
        request_id = request_id or uuid.uuid4().hex
        self._validate(request_id, prompt_token_ids, sampling)
        seq = Sequence(request_id, list(prompt_token_ids), sampling, next(self._arrivals))
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(7), "little")
        seq.generator = torch.Generator().manual_seed(seed)
        self._sequences[request_id] = seq
        self._detokenize[request_id] = detokenize and self.tokenizer is not None
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its blocks are released now. False if unknown."""
        seq = self._sequences.pop(request_id, None)
        if seq is None:
            return False
        self._detokenize.pop(request_id, None)
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._publish_events()
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def num_active(self) -> int:
        return len(self._sequences)

    def _validate(self, request_id: str, ids: list[int], sampling: SamplingParams) -> None:
        if request_id in self._sequences:
            raise InvalidRequestError(f"request_id {request_id!r} is already in flight")
        if not ids:
            raise InvalidRequestError("prompt is empty: give at least 1 token")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids):,} tokens; this engine's context is {self.max_model_len:,} "
                f"(the prompt must leave room for at least 1 generated token)")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequestError("sampling must be a SamplingParams")

    # --- the step -------------------------------------------------------------------
    def step(self, on_layer_done: LayerDoneCallback | None = None) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if not out.chunks:
            return []
        logits, sampled = self.runner.run(out.chunks, on_layer_done)
        self.scheduler.after_step(out.chunks)
        seqs = [c.seq for c in sampled]
        tokens = sample(logits, [s.sampling for s in seqs], [s.generator for s in seqs])
        outputs = [self._append_token(seq, tok) for seq, tok in zip(seqs, tokens, strict=True)]
        self._publish_events()
        return outputs

    def _append_token(self, seq: Sequence, token: int) -> RequestOutput:
        seq.token_ids.append(token)
        seq.usage.completion_tokens += 1
        delta = self._update_text(seq) if self._detokenize[seq.request_id] else ""
        reason = self._finish_reason(seq, token)
        if reason == "stop_string":
            delta, reason = self._truncate_at_stop(seq, delta), "stop"
        if reason is not None:
            self._sequences.pop(seq.request_id, None)
            self._detokenize.pop(seq.request_id, None)
            status = SequenceStatus.FINISHED_STOPPED if reason == "stop" else SequenceStatus.FINISHED_LENGTH
            self.scheduler.finish(seq, status)
        return RequestOutput(seq.request_id, [token], delta, reason is not None, reason, seq.usage)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.sampling
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.model_config.eos_token_ids):
            return "stop"
        if p.stop and any(s in seq.text for s in p.stop):
            return "stop_string"
        if seq.usage.completion_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _update_text(self, seq: Sequence) -> str:
        text = self.tokenizer.decode(seq.output_token_ids)
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        delta = text[len(seq.text):]
        seq.text = text
        return delta

    @staticmethod
    def _truncate_at_stop(seq: Sequence, delta: str) -> str:
        cut = min(seq.text.find(s) for s in seq.sampling.stop if s in seq.text)
        dropped = len(seq.text) - cut
        seq.text = seq.text[:cut]
        return delta[:max(0, len(delta) - dropped)]

    def _publish_events(self) -> None:
        events = self.pool.drain_events()
        if events:
            self.publisher.publish(events)

    # --- convenience ------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams],
                 detokenize: bool = True) -> list[RequestResult]:
        """Run prompts together through continuous batching until all finish; results in order."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ids = [self.add_request(p, s, detokenize=detokenize) for p, s in zip(prompts, params, strict=True)]
        results = {rid: RequestResult(rid) for rid in ids}
        while self.has_unfinished():
            for o in self.step():
                r = results.get(o.request_id)
                if r is None:
                    continue
                r.token_ids.extend(o.new_token_ids)
                r.text += o.text_delta
                r.finish_reason, r.usage = o.finish_reason, o.usage
        return [results[rid] for rid in ids]

    def leaked_blocks(self) -> list[int]:
        """Blocks still referenced by anyone; empty when the engine is idle and clean."""
        return self.pool.leaked_blocks()
