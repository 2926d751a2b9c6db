"""Builders shared by the transfer tests: a prefill side, a decode side, a reference run."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from pdserve.kvwire import KVLayout
from pdserve.transfer.prefill import PrefillOutcome, prefill_and_push
from pdserve.transfer.receiver import KVReceiver
from pdserve.transfer.sender import KVChannel, LayerwiseSender

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def layout_of(engine: LLMEngine) -> KVLayout:
    return KVLayout.of_cache(engine.kv_cache, engine.fingerprint)


@dataclass
class PrefillSide:
    engine: LLMEngine
    sender: LayerwiseSender

    @classmethod
    def of(cls, engine: LLMEngine, max_chunk_bytes: int = 2 << 20) -> PrefillSide:
        return cls(engine, LayerwiseSender(engine.kv_cache, layout_of(engine), max_chunk_bytes))

    def push(self, request_id: str, prompt: list[int], channel: KVChannel, receiver_cached_blocks: int = 0,
             sampling: SamplingParams = GREEDY, timeout_s: float = 30.0) -> PrefillOutcome:
        return prefill_and_push(self.engine, self.sender, request_id, prompt, sampling,
                                receiver_cached_blocks, channel, timeout_s)


def decode_after_transfer(engine: LLMEngine, request_id: str, prompt: list[int], first_token: int,
                          rng_state, sampling: SamplingParams = GREEDY) -> tuple[list[int], bool]:
    """Continue a transferred request, or prefill locally when no KV is parked.

    Returns (tokens, used_transferred_kv).
    """
    resumed = engine.resume_transferred(request_id, first_token, sampling, rng_state, detokenize=False)
    if resumed is not None:
        tokens = [first_token]
    else:
        engine.add_request(prompt, sampling, request_id=request_id, detokenize=False)
        tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
    return tokens, resumed is not None


def single_engine_tokens(engine: LLMEngine, prompt: list[int],
                         sampling: SamplingParams = GREEDY) -> list[int]:
    return engine.generate([prompt], sampling, detokenize=False)[0].token_ids


def receiver_for(engine: LLMEngine) -> KVReceiver:
    return KVReceiver(engine, layout_of(engine))
