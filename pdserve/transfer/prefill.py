"""Remote prefill on one engine: compute a prompt, stream its KV, return the first token.

The caller (a prefill worker) owns the engine; this drives engine.step() itself until
the request's first token is sampled, with the sender hooked into every layer.
On any transfer failure the request's blocks are released and TransferFailed is
raised: the decode side then prefills locally, so output stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams, Usage
from pdserve.transfer.sender import KVChannel, LayerwiseSender, PushResult


@dataclass(frozen=True)
class PrefillOutcome:
    first_token: int
    rng_state: torch.Tensor  # the request's generator after sampling first_token
    usage: Usage
    push: PushResult


def prefill_and_push(engine: LLMEngine, sender: LayerwiseSender, request_id: str, prompt: list[int],
                     sampling: SamplingParams, receiver_cached_blocks: int, channel: KVChannel,
                     timeout_s: float = 30.0) -> PrefillOutcome:
    engine.add_request(prompt, replace(sampling, max_tokens=1, stop=()), request_id=request_id,
                       detokenize=False, hold_blocks=True)
    transfer = sender.start(request_id, prompt, receiver_cached_blocks, channel, timeout_s)
    try:
        last = None
        while last is None:
            last = next((o for o in engine.step(on_layer_done=sender) if o.request_id == request_id), None)
        transfer.close()
        push = transfer.wait()
    except BaseException:
        transfer.abort()
        engine.abort(request_id)
        raise
    finally:
        sender.finish(request_id)
        engine.release_held(request_id)
    return PrefillOutcome(last.new_token_ids[0], last.rng_state, last.usage, push)
