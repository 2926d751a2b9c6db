"""1 prefill + 2 decode and 2 prefill + 1 decode: 16 concurrent requests, all exact."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from pdserve.engine.sequence import SamplingParams
from tests.conftest import make_engine
from tests.helpers.ray_cluster import client_of, start_cluster, wait_until_cluster_clean

TOPICS = ["rivers", "owls", "bread", "trains", "glaciers", "violins", "tea", "comets"]


def requests_16(tokenizer) -> list[list[int]]:
    texts = [f"Write two sentences about {t}." for t in TOPICS] + \
            [f"Give one surprising fact about {t}, in detail, for a curious reader." for t in TOPICS]
    return [tokenizer.apply_chat_template([{"role": "user", "content": x}]) for x in texts]


@pytest.fixture(scope="module")
def expected(smollm_loaded):
    prompts = requests_16(smollm_loaded.tokenizer)
    engine = make_engine(smollm_loaded)
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=20), detokenize=False)
    return prompts, [r.token_ids for r in results]


@pytest.mark.parametrize("num_prefill, num_decode", [(1, 2), (2, 1)], ids=["1P+2D", "2P+1D"])
def test_16_concurrent_requests_complete_exactly(ray_session, expected, num_prefill, num_decode):
    prompts, tokens = expected
    cluster = start_cluster(num_prefill, num_decode, routing="least_load")
    try:
        with client_of(cluster) as client, cf.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(client.generate, token_ids=p, temperature=0, max_tokens=20)
                       for p in prompts]
            done = [f.result() for f in futures]
        assert [d.token_ids for d in done] == tokens
        assert {d.decode_worker for d in done} == {f"decode-{i}" for i in range(num_decode)}
        assert {d.prefill_worker for d in done} == {f"prefill-{i}" for i in range(num_prefill)}
        wait_until_cluster_clean(cluster)
    finally:
        cluster.stop()
