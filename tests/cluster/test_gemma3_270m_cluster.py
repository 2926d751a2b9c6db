"""Gemma 3 270M (a base model, `make gemma3`) served by the cluster `pdserve up --model gemma3-270m`
starts (real Ray actors, embedded Redis), through the official openai SDK: a completion and a chat
through its turn template, each the tokens one in-process engine gives. Skipped, saying how to
install it, where the package is not installed."""

from __future__ import annotations

import openai
import pytest

from deploy.redis_server import free_port
from pdserve.engine.sequence import SamplingParams
from tests.conftest import make_engine
from tests.helpers.ray_cluster import start_cluster, wait_until_cluster_clean

SERVED = "gemma-3-270m"
TOKENS = 16


@pytest.fixture(scope="module")
def gemma_loaded():
    from pdserve.engine.named_models import MODELS
    from pdserve.engine.weights import load_model

    try:
        path = MODELS["gemma3-270m"].locate()
    except FileNotFoundError as e:
        pytest.skip(f"Gemma 3 270M is not installed: {e}")
    return load_model(path, progress=False)


@pytest.fixture(scope="module")
def cluster(ray_session, gemma_loaded):
    cluster = start_cluster(1, 1, num_blocks=256, http_port=free_port(), model="gemma3-270m")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.router.http_url + "/v1", api_key="unused", max_retries=0)


def engine_tokens(loaded, prompt: list[int]) -> list[int]:
    greedy = SamplingParams(temperature=0, max_tokens=TOKENS)
    return make_engine(loaded).generate([prompt], greedy, detokenize=False)[0].token_ids


def test_the_model_is_served_under_googles_name_as_a_gemma3(client):
    [model] = client.models.list().data
    assert (model.id, model.architecture) == (SERVED, "gemma3")


def test_a_completion_gives_one_engines_tokens(client, cluster, gemma_loaded):
    answer = client.completions.create(model=SERVED, prompt="The capital of France is", max_tokens=TOKENS,
                                       temperature=0, extra_body={"return_token_ids": True})
    prompt = gemma_loaded.tokenizer.encode("The capital of France is", add_special_tokens=True)
    assert answer.choices[0].token_ids == engine_tokens(gemma_loaded, prompt)
    assert answer.choices[0].text == gemma_loaded.tokenizer.decode(answer.choices[0].token_ids)
    wait_until_cluster_clean(cluster)


def test_a_chat_goes_through_its_turn_template(client, cluster, gemma_loaded):
    messages = [{"role": "user", "content": "Name a large city in France."}]
    answer = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=TOKENS, temperature=0,
                                            extra_body={"return_token_ids": True})
    prompt = gemma_loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert gemma_loaded.tokenizer.decode(prompt[-3:], skip_special_tokens=False).endswith("model\n")
    tokens = answer.choices[0].token_ids  # the engine's may end with the <end_of_turn> the API leaves out
    assert tokens and tokens == engine_tokens(gemma_loaded, prompt)[:len(tokens)]
    assert answer.usage.prompt_tokens == len(prompt)
    wait_until_cluster_clean(cluster)
