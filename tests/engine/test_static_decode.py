"""The static decode step (pdserve/engine/static_decode.py), run eagerly on the CPU: padding a batch to its
bucket changes no real row's logits or KV, and nothing in the step reads a tensor's value on the host
(what lets CUDA capture it as a graph).

Two engines on the same weights run the same requests, one with decode_step dynamic (each step's
tensors at its own size), one with decode_step static; every step's logits and the whole pool after
the run must be equal bit for bit, and the static engine must have run padded buckets.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import null_block_of
from pdserve.engine.sequence import SamplingParams
from pdserve.engine.static_decode import BATCH_BUCKETS, bucket_of, buckets_up_to
from tests.conftest import assert_no_leaks

NUM_BLOCKS = 64


def engine(loaded, decode_step: str, kv_dtype: str = "float32", attention: str = "auto") -> LLMEngine:
    cache = CacheConfig(block_size=16, num_blocks=NUM_BLOCKS, kv_dtype=kv_dtype)
    return LLMEngine(loaded, EngineConfig(cache=cache, scheduler=SchedulerConfig(max_num_seqs=8),
                                          device="cpu", decode_step=decode_step, attention_kernel=attention))


def record_steps(eng: LLMEngine) -> list[tuple[int, torch.Tensor]]:
    """Each step's (rows, logits), as the runner returns them."""
    steps: list[tuple[int, torch.Tensor]] = []
    run = eng.runner.run

    def recording(chunks, on_layer_done=None):
        logits, sampled = run(chunks, on_layer_done)
        steps.append((len(chunks), logits.clone()))
        return logits, sampled

    eng.runner.run = recording
    return steps


def run_requests(eng: LLMEngine, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        eng.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), f"r{i}")
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def prompts_of(vocab: int) -> tuple[list[list[int]], list[int]]:
    """Five prompts of 1 to 40 tokens; their lengths differ, so the batch shrinks from 5 to 1 (buckets 8,
    4, 2, 1) as they finish."""
    g = torch.Generator().manual_seed(7)
    lengths, max_tokens = [1, 9, 16, 17, 40], [3, 5, 7, 9, 12]
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths], max_tokens


def test_buckets():
    assert buckets_up_to(64) == (1, 2, 4, 8, 16, 32, 64)
    assert buckets_up_to(5) == (1, 2, 4, 8)
    assert buckets_up_to(1000) == BATCH_BUCKETS
    assert [bucket_of(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_padded_steps_give_the_dynamic_steps_logits_and_kv_bit_for_bit(tiny_loaded):
    """On the CPU's defaults (native attention, float32 cache); tests/engine/test_triton_engine.py runs the
    static step on Triton's kernels and int8 rows."""
    dynamic, static = engine(tiny_loaded, "dynamic"), engine(tiny_loaded, "static")
    assert static.runner.static_decode is not None and dynamic.runner.static_decode is None
    ran: list[int] = []
    static_run = static.runner.static_decode.run
    static.runner.static_decode.run = lambda chunks: (ran.append(len(chunks)), static_run(chunks))[1]
    dynamic_steps, static_steps = record_steps(dynamic), record_steps(static)
    prompts, max_tokens = prompts_of(tiny_loaded.config.vocab_size)

    assert run_requests(static, prompts, max_tokens) == run_requests(dynamic, prompts, max_tokens)

    assert {bucket_of(rows, static.runner.static_decode.buckets) for rows in ran} >= {8, 4, 2, 1}
    assert any(rows not in BATCH_BUCKETS for rows in ran), "some step must be padded"
    assert [rows for rows, _ in static_steps] == [rows for rows, _ in dynamic_steps]
    for (_, a), (_, b) in zip(static_steps, dynamic_steps, strict=True):
        assert torch.equal(a, b)
    # every block a sequence can own holds the same bytes; padding wrote the null block only
    null = null_block_of(static.kv_cache)
    assert null == NUM_BLOCKS
    assert torch.equal(static.kv_cache[:, :, :null], dynamic.kv_cache[:, :, :null])
    assert not torch.equal(static.kv_cache[:, :, null], dynamic.kv_cache[:, :, null])
    assert_no_leaks(static)
    assert_no_leaks(dynamic)


def test_the_step_reads_no_tensor_value_on_the_host(tiny_loaded, monkeypatch):
    """What a graph capture needs: no .item(), int(tensor), bool(tensor) or .tolist() in the step (the
    host-side filling of its inputs from Python lists is before the step, and is replayed by copies)."""
    eng = engine(tiny_loaded, "static")
    static = eng.runner.static_decode
    forward = static._forward

    def no_host_reads(bucket):
        def refuse(*_args, **_kwargs):
            raise AssertionError("the static decode step read a tensor's value on the host")

        with monkeypatch.context() as m:
            for name in ("item", "tolist", "__int__", "__bool__", "__float__", "__index__"):
                m.setattr(torch.Tensor, name, refuse)
            return forward(bucket)

    static._forward = no_host_reads
    prompts, max_tokens = prompts_of(tiny_loaded.config.vocab_size)
    tokens = run_requests(eng, prompts[:3], max_tokens[:3])
    assert [len(t) for t in tokens] == max_tokens[:3]
    assert_no_leaks(eng)


def test_static_needs_a_paged_attention_kernel(tiny_loaded):
    with pytest.raises(ValueError, match="needs a paged attention kernel"):
        engine(tiny_loaded, "static", attention="sdpa")


def test_auto_is_dynamic_on_the_cpu(tiny_loaded):
    assert engine(tiny_loaded, "auto").runner.static_decode is None
