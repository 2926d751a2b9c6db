"""The OpenAI-compatible HTTP API of the cluster `pdserve up` starts (deploy.launcher.LocalCluster: real
Ray actors, embedded Redis, SmolLM2), driven with the official openai SDK as an app would, and with raw
HTTP where the SDK hides what is checked (a dropped stream). Every flow ends with the leak check.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch

from deploy.redis_server import free_port
from pdserve.engine.sequence import SamplingParams
from pdserve.engine.weights import DEFAULT_MODEL_NAME
from pdserve.metrics import scrape
from tests.conftest import make_engine
from tests.helpers.cluster import metric_value
from tests.helpers.ray_cluster import client_of, start_cluster, wait_until_cluster_clean

BLOCK = 16
PARIS = [{"role": "user", "content": "What is the capital of France?"}]



@pytest.fixture(scope="module")
def cluster(ray_session):
    cluster = start_cluster(1, 1, num_blocks=512, http_port=free_port())
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.router.http_url + "/v1", api_key="unused", max_retries=0)


def greedy_chat(client: openai.OpenAI, messages, max_tokens: int = 24, **extra):
    return client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                          temperature=0, **extra)


def test_models_list_names_the_model_with_its_context(client):
    models = client.models.list().data
    assert [m.id for m in models] == [DEFAULT_MODEL_NAME]
    assert models[0].max_model_len == 8192
    assert models[0].pdserve["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.9, "top_k": 0,
                                                      "source": "SmolLM2 model card"}


def test_a_request_without_sampling_fields_samples_with_the_models_defaults(client, cluster, smollm_loaded):
    prompt = smollm_loaded.tokenizer.encode("My name is Ana. What is 2+2?")
    answer = client.completions.create(model=DEFAULT_MODEL_NAME, prompt=prompt, max_tokens=10, seed=7,
                                       extra_body={"return_token_ids": True})
    explicit = SamplingParams(temperature=0.2, top_p=0.9, seed=7, max_tokens=10)
    engine = make_engine(smollm_loaded).generate([prompt], explicit, detokenize=False)[0]
    assert answer.choices[0].token_ids == engine.token_ids
    wait_until_cluster_clean(cluster)


def test_a_chat_completion_answers_paris_and_a_stream_assembles_the_same_text(client, cluster):
    whole = greedy_chat(client, PARIS)
    stream = greedy_chat(client, PARIS, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in whole.choices[0].message.content
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    wait_until_cluster_clean(cluster)


def test_async_openai_runs_8_concurrent_streams(cluster):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        messages = [{"role": "user", "content": f"Count from {i % 2} to 9."}]
        stream = await client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=messages,
                                                      max_tokens=12, temperature=0, stream=True)
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main():
        async with openai.AsyncOpenAI(base_url=cluster.router.http_url + "/v1", api_key="unused") as client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))

    results = asyncio.run(main())
    assert all(text and reason in ("stop", "length") for text, reason in results)
    assert len({results[i][0] for i in range(0, 8, 2)}) == 1  # the same prompt, greedy: the same text
    assert len({results[i][0] for i in range(1, 8, 2)}) == 1
    wait_until_cluster_clean(cluster)


def test_greedy_token_ids_over_http_equal_grpc_and_the_engine(client, cluster, smollm_loaded):
    prompt = smollm_loaded.tokenizer.encode("The three primary colors are")
    answer = client.completions.create(model=DEFAULT_MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    with client_of(cluster) as grpc_client:
        over_grpc = grpc_client.generate(token_ids=prompt, temperature=0, max_tokens=12, ignore_eos=True)
    engine = make_engine(smollm_loaded).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), detokenize=False)[0]
    assert answer.choices[0].token_ids == list(over_grpc.token_ids) == engine.token_ids
    assert answer.usage.prompt_tokens == len(prompt) and answer.usage.completion_tokens == 12
    wait_until_cluster_clean(cluster)


def test_turn_two_of_a_chat_reports_turn_one_as_cached_tokens(client, cluster):
    first = [{"role": "system", "content": "You are a helpful travel guide."},
             {"role": "user", "content": "Name three sights in Rome, with one sentence each."}]
    turn1 = greedy_chat(client, first, max_tokens=48)
    second = [*first, {"role": "assistant", "content": turn1.choices[0].message.content},
              {"role": "user", "content": "Which of them is the oldest?"}]
    turn2 = greedy_chat(client, second, max_tokens=8)
    reused = turn1.usage.prompt_tokens + turn1.usage.completion_tokens - 1
    assert turn2.usage.prompt_tokens_details.cached_tokens >= reused // BLOCK * BLOCK
    wait_until_cluster_clean(cluster)


def test_logprobs_are_the_engines_log_softmax_with_sorted_alternatives(client, cluster, smollm_loaded):
    answer = greedy_chat(client, PARIS, max_tokens=6, logprobs=True, top_logprobs=5,
                         extra_body={"return_token_ids": True})
    entries = answer.choices[0].logprobs.content
    generated = answer.choices[0].token_ids
    prompt = smollm_loaded.tokenizer.apply_chat_template(PARIS, add_generation_prompt=True)
    with torch.inference_mode():
        logits = make_engine(smollm_loaded).model.reference_logits(prompt + generated)
    expected = torch.log_softmax(logits[len(prompt) - 1:-1].float(), dim=-1)
    assert len(entries) == len(generated) == 6
    for step, (entry, token) in enumerate(zip(entries, generated, strict=True)):
        assert token == int(expected[step].argmax())  # greedy: the sampled token is the argmax
        assert entry.logprob == pytest.approx(float(expected[step, token]), abs=1e-4)
        top = [alt.logprob for alt in entry.top_logprobs]
        assert len(top) == 5 and top == sorted(top, reverse=True)
        assert entry.top_logprobs[0].token == entry.token
    wait_until_cluster_clean(cluster)


def test_a_client_that_drops_a_stream_after_3_chunks_frees_every_block_within_5_s(cluster):
    metrics = f"http://{cluster.router.metrics_address}/metrics"
    cancelled = metric_value(scrape(metrics), "pdserve_router_requests_total", code="CANCELLED")
    body = {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster.router.http_url + "/v1/chat/completions", json=body, timeout=60) as r:
        chunks = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line)
            if len(chunks) == 3:
                break
    wait_until_cluster_clean(cluster, timeout_s=5)
    assert len(chunks) == 3
    assert metric_value(scrape(metrics), "pdserve_router_requests_total", code="CANCELLED") == cancelled + 1


def test_a_character_split_across_tokens_is_streamed_only_when_whole(client, cluster, smollm_loaded):
    # Greedy SmolLM2 answers this with star emoji, 3 byte-level tokens each (4 UTF-8 bytes)
    ask = [{"role": "user", "content": "Reply with one emoji for a happy face."}]
    chunks = [c for c in greedy_chat(client, ask, max_tokens=16, stream=True,
                                     extra_body={"return_token_ids": True}) if c.choices]
    deltas = [(c.choices[0].delta.content or "", c.choices[0].token_ids or []) for c in chunks
              if getattr(c.choices[0], "token_ids", None)]
    ids = [t for _, got in deltas for t in got]
    assert any(not text for text, _ in deltas)  # a token that ended inside a character: held
    assert all("\ufffd" not in text for text, _ in deltas)
    whole = smollm_loaded.tokenizer.decode(ids)
    assert "".join(text for text, _ in deltas) == whole.rstrip("\ufffd") and "🌟" in whole
    wait_until_cluster_clean(cluster)
