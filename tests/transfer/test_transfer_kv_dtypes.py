"""int8 and fp8 KV over the transfer, on every channel (tests/helpers/rig.py): the blocks travel with
their scales and decode exactly like the no-cache reference of their dtype; a worker whose pool holds
another dtype refuses the transfer at BEGIN, and the prompt is recomputed there, exactly."""

from __future__ import annotations

import grpc
import pytest

from tests.conftest import make_engine
from tests.engine.test_exactness import reference_greedy
from tests.helpers.rig import (
    CHANNELS,
    GREEDY,
    assert_no_wrong_kv,
    cached_prompt_blocks,
    engine_config,
    start_rig,
)
from tests.helpers.workers import wait_until_clean

PROMPT = list(range(300, 350))  # 50 tokens: 3 full blocks of 16 and a partial one


@pytest.fixture(params=CHANNELS)
def kind(request) -> str:
    return request.param


def no_cache_tokens(loaded, kv_dtype: str, prompt: list[int]) -> list[int]:
    return reference_greedy(make_engine(loaded, kv_dtype=kv_dtype), prompt, GREEDY.max_tokens)[0]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_kv_transfers_with_its_scales_and_decodes_like_the_reference(tiny_loaded, kind, kv_dtype):
    c = tiny_loaded.config
    rig = start_rig(tiny_loaded, kind, prefill_engine=engine_config(budget=20, kv_dtype=kv_dtype),
                    decode_engine=engine_config(kv_dtype=kv_dtype), max_chunk_bytes=4096)
    try:
        reply = rig.remote_prefill("q1", PROMPT)
        block_bytes = 2 * 16 * c.num_kv_heads * (c.head_dim + 4)  # K and V rows, each with its scale
        assert rig.prefill.layout.block_bytes == block_bytes
        assert (reply.blocks_sent, reply.bytes_sent) == (4 * c.num_layers, 4 * c.num_layers * block_bytes)
        tokens, used = rig.decode_tokens("q1", PROMPT, reply)
        assert used and tokens == no_cache_tokens(tiny_loaded, kv_dtype, PROMPT)
        wait_until_clean(rig.prefill, rig.decode)
        assert_no_wrong_kv(rig.prefill, rig.decode)  # the KV audit of both pools, by the dtype's rule
    finally:
        rig.close()


@pytest.mark.parametrize(("sent", "held"), [("int8", "float32"), ("fp8", "int8"), ("float16", "int8")])
def test_a_block_of_another_dtype_is_refused_at_the_handshake(tiny_loaded, kind, sent, held):
    rig = start_rig(tiny_loaded, kind, prefill_engine=engine_config(kv_dtype=sent),
                    decode_engine=engine_config(kv_dtype=held))
    try:
        with pytest.raises(grpc.RpcError) as failure:
            rig.remote_prefill("q2", PROMPT)
        assert failure.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert f"kv_dtype: sender {sent}, receiver {held}" in failure.value.details()
        assert rig.decode.status().transfer_outcomes == {"FAILED_PRECONDITION": 1}
        assert cached_prompt_blocks(rig.decode, PROMPT) == 0
        tokens, used = rig.decode_tokens("q2", PROMPT)  # D prefills the prompt itself, in its own dtype
        assert not used and tokens == no_cache_tokens(tiny_loaded, held, PROMPT)
        wait_until_clean(rig.prefill, rig.decode)
        assert_no_wrong_kv(rig.prefill, rig.decode)
    finally:
        rig.close()
