"""A prompt's KV moves from a prefill worker to a decode worker exactly in every family: the decode
worker's tokens are one engine's, for a prompt longer than the family's window (tiny twins,
write_tiny_model(arch=...); production WorkerServers over real gRPC: tests/helpers/rig.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.tiny_model import TINY_ARCHS
from tests.helpers.rig import assert_no_wrong_kv, engine_config, reference_tokens, start_rig
from tests.helpers.workers import wait_until_clean

PROMPT_TOKENS = 90  # longer than every tiny window (40, 24) and llama3's original 64 positions


@pytest.mark.parametrize("arch", tuple(TINY_ARCHS))
def test_transferred_kv_decodes_exactly_like_one_engine(family_model, arch):
    _, loaded = family_model(arch)
    prompt = torch.randint(100, loaded.config.vocab_size, (PROMPT_TOKENS,),
                           generator=torch.Generator().manual_seed(8)).tolist()
    rig = start_rig(loaded, "grpc", prefill_engine=engine_config(budget=20))  # chunked prefill
    try:
        reply = rig.remote_prefill("r1", prompt)
        assert reply.blocks_sent == 6 * loaded.config.num_layers  # 90 tokens: 6 blocks of 16, per layer
        tokens, used = rig.decode_tokens("r1", prompt, reply)
        assert used and tokens == reference_tokens(loaded, prompt)
        wait_until_clean(rig.prefill, rig.decode)
        assert_no_wrong_kv(rig.prefill, rig.decode)
    finally:
        rig.close()
