"""The engine: requests in, tokens out, one step at a time.

    add_request -> validate -> Sequence (WAITING); with `generated`, a continued request (a stream
        migrated from another worker): the tokens an earlier run generated are replayed with the
        prompt (or found in the prefix cache) and count as its output (engine/sequence.py)
    step():  scheduler.schedule -> model_runner.run -> scheduler.after_step
             -> sample (each random row's draw keyed by its seed and the token's position:
                engine/sampler.py; and the logprobs of the rows that asked) -> detokenize / stop checks
             -> finished sequences release
             their blocks -> KV events drained to the publisher
    abort(request_id): blocks released at once, wherever the request is.

KV handoff (prefill/decode disaggregation): the state lives in self.handoff (engine/handoff.py,
its lifecycle in that module's docstring); the engine steps it and joins resumed requests.
    prefill side: step(observer) tells a KV sender as each layer is written
        (observer.layer_done) and when a sequence loses its blocks to preemption
        (observer.preempted, called before the scheduler looks at the pool again; a True
        answer drops the request, which finishes as "abort" in that step's outputs). The
        sender pins the blocks it reads (handoff.pin / unpin).
    decode side: handoff.reserve -> (blocks written by the receiver) -> handoff.park ->
        resume_transferred(prompt, first_token, first_logprob, generated): handoff.claim checks
        the request against what was parked, and the request joins the continuous batch
        (scheduler.add_running). A resume that is refused or raises frees the parked KV; step()
        frees parked KV past its expiry.

Locking: self.lock (an RLock) guards requests, blocks and the hand-off state, so gRPC threads
may call in while the engine loop steps.
    take it:     add_request, abort, step (its StepObserver runs under it), resume_transferred,
                 discard_block, and every method of self.handoff but num_parked. Code that reads
                 the pool or kv_cache directly (the KV audit, the index resync) takes it too.
    do not:      has_unfinished and load: liveness and status must never wait behind a step,
                 which can hold the lock for seconds on a CPU; they read len()s, atomic under
                 the GIL. leaked_blocks: a check for an idle engine (tests, drain, benchmarks);
                 mid-step it may see a step's own references. generate: each add_request and
                 step it calls takes the lock; nothing is held between them.

Validation (engine/validation.py) happens before anything is queued, so a bad request raises
InvalidRequestError and the engine keeps serving the others.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from pdserve.engine.block_pool import BlockPool, Discarded, TierUsage
from pdserve.engine.config import DeviceMemory, EngineConfig, activation_reserve_bytes
from pdserve.engine.cpu_allocator import release_freed_memory, retain_freed_memory
from pdserve.engine.events import KVEventPublisher, NullPublisher
from pdserve.engine.handoff import KVHandoff, Reservation
from pdserve.engine.hashing import BlockHash, engine_salt
from pdserve.engine.host_tier import build_lower_tier
from pdserve.engine.kernel_choice import choose_kernels, find_support
from pdserve.engine.kv_format import TORCH_DTYPES
from pdserve.engine.linear import select_linear
from pdserve.engine.model import DecoderModel, select_attention
from pdserve.engine.model_runner import ModelRunner, allocate_kv_cache, null_block_of
from pdserve.engine.pointwise import select_pointwise
from pdserve.engine.sampler import sample, token_logprobs, uniform
from pdserve.engine.scheduler import ScheduledChunk, Scheduler, StepShape
from pdserve.engine.sequence import SamplingParams, Sequence, SequenceStatus, TokenLogprob, Usage
from pdserve.engine.static_decode import StaticDecode
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.validation import EngineLimits, InvalidRequestError, check_cache_salt
from pdserve.engine.weights import LoadedModel, load_model
from pdserve.units import ceil_div


class StepObserver(Protocol):
    """What a KV sender sees of each step (prefill_worker/sender.py). Both run on the engine's
    thread, under its lock."""

    def layer_done(self, layer: int, chunks: list[ScheduledChunk]) -> None:
        """Layer `layer` of every chunk of this step has been written to the pool."""
        ...

    def preempted(self, seq: Sequence) -> bool:
        """seq just lost its blocks to preemption; True drops the request (it finishes "abort")."""
        ...


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    num_blocks: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    parked_transfers: int
    tiers: tuple[TierUsage, ...] = ()  # device pool, then host and disk where configured


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    usage: Usage
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token; empty: not asked


@dataclass
class RequestResult:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token; empty: not asked


def select_device(requested: str | None) -> torch.device:
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def gpu_memory(device: torch.device) -> DeviceMemory | None:
    """A CUDA device's free and total bytes as the pool is sized (CacheConfig.resolve_num_blocks), with
    the weights loaded; None on the CPU. NOTE: empty_cache first: the loader's copies the model freed
    are still held by torch's caching allocator, and mem_get_info counts them as used."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(free, total)


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig,
                 publisher: KVEventPublisher | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = select_device(config.device)
        # NOTE: dtype and kv_dtype's auto resolved once, here, before anything reads them: self.config
        # holds the concrete dtypes every reader sees (the salt, the kernels, the pool and its size, the
        # KV wire layout, the registry and the audit).
        config, dtypes = config.resolved(self.device.type)
        self.config = config
        self.model_config = loaded.config
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.fingerprint = loaded.fingerprint
        self.sampling_defaults = loaded.sampling_defaults  # what `pdserve generate --local` leaves unset
        if self.device.type == "cpu" and config.retain_freed_memory:
            retain_freed_memory()  # NOTE: prefill's large temporaries stop faulting their pages in each step
        # NOTE: auto resolved once, here; self.kernels says what runs and why (the worker logs it and
        # reports it in its Status).
        self.kernels = replace(
            choose_kernels(config.linear_kernel, config.attention_kernel, config.pointwise_kernel,
                           find_support(self.device.type, config.cache.kv_dtype, config.dtype)),
            dtypes=dtypes)
        self.model = DecoderModel(loaded.config, loaded.state_dict, self.device,
                                select_linear(self.device, self.kernels.linear.kernel),
                                select_attention(self.device, self.kernels.attention.kernel),
                                select_pointwise(self.device, self.kernels.pointwise.kernel),
                                dtype=TORCH_DTYPES[config.dtype])
        cache = config.cache
        self.block_size = cache.block_size
        num_blocks = cache.resolve_num_blocks(
            loaded.config, gpu_memory(self.device),
            activation_reserve_bytes(loaded.config, config.scheduler.max_num_batched_tokens,
                                     config.scheduler.max_num_seqs, config.dtype))
        self.salt = engine_salt(loaded.fingerprint, cache.block_size, cache.kv_dtype,
                                architecture=loaded.config.architecture)
        self.kv_cache = allocate_kv_cache(self.model, num_blocks, cache.block_size, cache.kv_dtype)
        lower = build_lower_tier(self.kv_cache, cache, loaded.config, self.salt)
        self.pool = BlockPool(num_blocks, cache.block_size, lower)
        self.runner = ModelRunner(self.model, self.kv_cache, cache.block_size,
                                  self._static_decode(num_blocks, loaded.config.max_position_embeddings))
        self.scheduler = Scheduler(config.scheduler, self.pool, self.salt, cache.enable_prefix_caching)
        self.publisher = publisher or NullPublisher()
        self.max_model_len = min(loaded.config.max_position_embeddings, num_blocks * cache.block_size)
        self.limits = EngineLimits(loaded.config.vocab_size, self.max_model_len)
        self._sequences: dict[str, Sequence] = {}
        self._detokenize: dict[str, bool] = {}
        self._arrivals = itertools.count()
        self.last_step: StepShape | None = None  # what the latest step computed; None: it had nothing to run
        self.lock = threading.RLock()
        self.handoff = KVHandoff(self.pool, self.salt, self.limits, self.lock, self._sequences,
                                 self._publish_events)

    def _static_decode(self, num_blocks: int, max_positions: int) -> StaticDecode | None:
        """The static decode step where EngineConfig.decode_step resolves to it (auto: on CUDA, where the
        attention is a paged kernel), captured as CUDA graphs unless enforce_eager; else None."""
        step = self.config.decode_step
        if step == "auto":
            paged = self.model.paged_attention is not None
            step = "static" if self.device.type == "cuda" and paged else "dynamic"
        if step == "dynamic":
            return None
        block_size = self.config.cache.block_size
        max_blocks = ceil_div(min(max_positions, num_blocks * block_size), block_size)
        graphs = self.device.type == "cuda" and not self.config.enforce_eager
        return StaticDecode(self.model, self.kv_cache, block_size, null_block_of(self.kv_cache),
                            self.config.scheduler.max_num_seqs, max_blocks, graphs)

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = True,
                    publisher: KVEventPublisher | None = None) -> LLMEngine:
        """Load the model and build the engine; the weights as loaded are freed once prepared (the
        engine keeps its kernels' copies only), and their pages go back to the system."""
        engine = cls(load_model(config.model_path, progress=progress), config, publisher)
        if engine.device.type == "cpu":
            release_freed_memory()
        return engine

    # --- requests ---------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams,
                    request_id: str | None = None, detokenize: bool = True, cache_salt: bytes = b"",
                    generated: Iterable[int] = ()) -> str:
        """Queue a request; InvalidRequestError (nothing queued) when it is malformed. cache_salt:
        the request's own prefix-cache salt (pdserve/engine/hashing.py request_salt). generated:
        continue a request after the tokens an earlier run of it generated (same prompt, same
        sampling): they count as output, and what follows is what that run would have drawn."""
        request_id = request_id or uuid.uuid4().hex
        generated = tuple(generated)
        with self.lock:
            self._validate(request_id, prompt_token_ids, sampling, generated)
            check_cache_salt(cache_salt)
            seq = self._new_sequence(request_id, prompt_token_ids, sampling, detokenize, cache_salt,
                                     generated)
            self.scheduler.add(seq)
        return request_id

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                      detokenize: bool, cache_salt: bytes, generated: tuple[int, ...] = ()) -> Sequence:
        # NOTE: a request without a seed gets one here; behind a router it always has one (the
        # router picks it, router/service.py), so that its stream can be continued exactly.
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little")
        seq = Sequence(request_id, list(prompt_token_ids), sampling, next(self._arrivals),
                       seed=seed, cache_salt=cache_salt, generated=generated)
        self._sequences[request_id] = seq
        self._detokenize[request_id] = detokenize and self.tokenizer is not None
        if generated and self._detokenize[request_id]:
            seq.text = self._text_before(prompt_token_ids, generated)
        return seq

    def _text_before(self, prompt: list[int], generated: tuple[int, ...]) -> str:
        """The text an uninterrupted run had sent when it had generated these tokens: that of the
        longest prefix of them that does not end inside a UTF-8 character (_update_text held the
        rest back), so the next delta carries what it held."""
        for end in range(len(generated), 0, -1):
            text = self.tokenizer.decode_after(prompt, generated[:end])
            if not text.endswith("\ufffd"):
                return text
        return ""

    def abort(self, request_id: str, parked: bool = True) -> bool:
        """Drop a request wherever it is; its blocks are released now. False if unknown. parked=False
        leaves KV parked under the id alone: a newer call's, which a transfer brought meanwhile."""
        with self.lock:
            seq = self._sequences.pop(request_id, None)
            if seq is None:
                return parked and self.handoff.drop(request_id)
            self._detokenize.pop(request_id, None)
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            self._publish_events()
            return True

    def _validate(self, request_id: str, ids: list[int], sampling: SamplingParams,
                  generated: tuple[int, ...]) -> None:
        if request_id in self._sequences:
            raise InvalidRequestError(f"request_id {request_id!r} is already in flight")
        self.limits.check_prompt(ids)
        self.limits.check_sampling(sampling)
        self.limits.check_continuation(len(ids), generated, sampling)

    # --- the step -------------------------------------------------------------------
    def step(self, observer: StepObserver | None = None) -> list[RequestOutput]:
        """One scheduling step; the observer sees each layer written and each preemption."""
        with self.lock:
            self.handoff.expire(time.monotonic())
            dropped: list[Sequence] = []
            out = self.scheduler.schedule(_on_preempt(observer, dropped))
            outputs = [self._drop_preempted(seq) for seq in dropped]
            self.last_step = StepShape.of(out.chunks) if out.chunks else None
            if out.chunks:
                outputs += self._run(out.chunks, observer)
            self._publish_events()
            return outputs

    def _run(self, chunks: list[ScheduledChunk], observer: StepObserver | None) -> list[RequestOutput]:
        hook = (lambda layer: observer.layer_done(layer, chunks)) if observer else None
        logits, sampled = self.runner.run(chunks, hook)
        self.scheduler.after_step(chunks)
        seqs = [c.seq for c in sampled]
        params = [s.sampling for s in seqs]
        tokens = sample(logits, params, [uniform(s.seed, s.num_tokens) for s in seqs])
        logprobs = token_logprobs(logits, tokens, params)
        return [self._append_token(seq, tok, lp) for seq, tok, lp in zip(seqs, tokens, logprobs, strict=True)]

    def _drop_preempted(self, seq: Sequence) -> RequestOutput:
        """A preempted request its observer gave up on: it ends here, as an abort."""
        self._sequences.pop(seq.request_id, None)
        self._detokenize.pop(seq.request_id, None)
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return RequestOutput(seq.request_id, [], "", True, "abort", seq.usage)

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput:
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
        return RequestOutput(seq.request_id, [token], delta, reason is not None, reason, seq.usage,
                             [] if logprob is None else [logprob])

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
        text = self.tokenizer.decode_after(seq.prompt_token_ids, seq.output_token_ids)
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
                r.logprobs.extend(o.logprobs)
                r.text += o.text_delta
                r.finish_reason, r.usage = o.finish_reason, o.usage
        return [results[rid] for rid in ids]

    # --- KV handoff: a transferred request joins the batch -----------------------------------
    def resume_transferred(self, request_id: str, prompt_token_ids: list[int], first_token: int,
                           sampling: SamplingParams, detokenize: bool = True, cache_salt: bytes = b"",
                           first_logprob: TokenLogprob | None = None,
                           generated: Iterable[int] = ()) -> RequestOutput | None:
        """Continue a parked transfer: its prompt's KV is here, first_token came from prefill, and
        with it first_logprob when sampling.logprobs asks (the prefill engine computed it from the
        logits first_token was sampled from; this engine never sees them). generated: as in
        add_request; the transferred KV is then of prompt + generated, the prefill worker's prompt.

        Returns the output for first_token (it may already finish the request), or None when
        nothing is parked under request_id (the caller prefills locally). Raises
        InvalidRequestError when the request does not match the parked prompt or a field is out
        of range; the parked KV is freed then, as it is when anything else raises, so a bad
        resume leaves nothing held.
        """
        generated = tuple(generated)
        with self.lock:
            reservation = self.handoff.claim(request_id, prompt_token_ids, first_token, sampling, cache_salt,
                                             first_logprob, generated)
            if reservation is None:
                return None
            seq = None
            try:
                seq = self._resumed_sequence(reservation, sampling, detokenize, generated)
                return self._append_token(seq, first_token, first_logprob)
            except BaseException:
                self._undo_resume(reservation, seq)
                raise

    def _resumed_sequence(self, reservation: Reservation, sampling: SamplingParams, detokenize: bool,
                          generated: tuple[int, ...]) -> Sequence:
        transferred = reservation.prompt_token_ids  # prompt + generated (claim checked it)
        prompt = transferred[:len(transferred) - len(generated)]
        seq = self._new_sequence(reservation.request_id, prompt, sampling, detokenize, reservation.cache_salt,
                                 generated)
        seq.block_ids = list(reservation.block_ids)
        seq.num_computed_tokens = seq.num_tokens
        seq.num_committed_blocks = seq.num_tokens // self.block_size
        seq.admitted_once = True
        seq.usage.cached_tokens = reservation.num_cached_blocks * self.block_size
        self.scheduler.add_running(seq)
        return seq

    def _undo_resume(self, reservation: Reservation, seq: Sequence | None) -> None:
        """A resume that raised half way: whoever holds the blocks now lets go of them."""
        if seq is not None and seq.status is SequenceStatus.RUNNING:
            self.abort(reservation.request_id)  # the sequence owns the blocks: it lets go of them
            return
        self._sequences.pop(reservation.request_id, None)
        self._detokenize.pop(reservation.request_id, None)
        if seq is None or not seq.status.finished:  # (a finished one already let go of them)
            self.handoff.release(reservation)

    # --- status: read without the lock -------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def load(self) -> EngineLoad:
        """Counts read WITHOUT the lock. NOTE: a prefill step can hold the lock for seconds on a
        CPU; a heartbeat or Status call waiting on it would let the worker's lease expire. Each
        count is a len() of a container the loop mutates, read atomically under the GIL; counts
        may disagree with each other by one step, never by a torn value."""
        pool = self.pool
        return EngineLoad(running=self.scheduler.num_running, waiting=self.scheduler.num_waiting,
                          num_blocks=pool.num_blocks, free_blocks=pool.num_free_blocks,
                          cached_blocks=pool.num_cached_blocks, used_blocks=pool.num_used_blocks,
                          parked_transfers=self.handoff.num_parked(), tiers=tuple(pool.tier_usage()))

    def leaked_blocks(self) -> list[int]:
        """Blocks still referenced by anyone; empty when the engine is idle and clean."""
        return self.pool.leaked_blocks()

    # --- KV audit (engine/audit.py) ------------------------------------------------------------
    def discard_block(self, block_id: int, block_hash: BlockHash) -> Discarded:
        """Take a block the KV audit found wrong out of the prefix cache and unpublish it
        (BlockRemoved through the publisher). A block in use loses its hash now, frees on release."""
        with self.lock:
            outcome = self.pool.discard(block_id, block_hash)
            self._publish_events()
            return outcome


def _on_preempt(observer: StepObserver | None, dropped: list[Sequence]) -> Callable[[Sequence], None] | None:
    """The scheduler's preemption callback: ask the observer, collect the requests it drops."""
    if observer is None:
        return None

    def on_preempt(seq: Sequence) -> None:
        if observer.preempted(seq):
            dropped.append(seq)
    return on_preempt
