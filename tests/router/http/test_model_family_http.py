"""Which family a cluster serves shows where a user looks: each worker's Status, `pdserve status`'s table
and /v1/models (OpenAI's shape, the family beside it as vLLM adds root and max_model_len); and a chat's
chat_template_kwargs reach the template the router renders. One in-process cluster of a tiny Gemma 3
(real gRPC and HTTP sockets), served under Gemma 3 270M's name, with a template that reads a kwarg."""

from __future__ import annotations

import httpx
import pytest

from deploy.cli import main
from pdserve.engine.tiny_model import write_tiny_model
from pdserve.engine.weights import load_model
from tests.helpers.cluster import running_cluster
from tests.helpers.workers import wait_until_clean
from tests.router.http.test_chat_template_kwargs import MESSAGES, THINKING_TEMPLATE

SERVED = "gemma-3-270m"


@pytest.fixture(scope="module")
def gemma_cluster(tiny_loaded, tmp_path_factory):
    directory = write_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), arch="gemma3",
                                 tokenizer=tiny_loaded.tokenizer)
    tiny_loaded.tokenizer.save(directory, chat_template=THINKING_TEMPLATE)
    loaded = load_model(str(directory), progress=False)
    with running_cluster(loaded, num_blocks=32, http_port=0, served_model_name=SERVED,
                         architecture=loaded.config.architecture) as cluster:
        yield cluster


def test_each_worker_and_pdserve_status_name_the_family(gemma_cluster, capsys):
    assert {w.status().architecture for w in gemma_cluster.workers} == {"gemma3"}
    assert main(["status", "--router", gemma_cluster.router.address]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-1] == "architecture"
    rows = [line.split() for line in lines[2:] if not line.startswith("kernels on ")]
    assert sorted((row[1], row[-1]) for row in rows) == [("decode", "gemma3"), ("prefill", "gemma3")]


def test_v1_models_lists_the_family_in_openais_shape(gemma_cluster):
    base = gemma_cluster.router.http_url
    (card,) = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
    assert list(card)[:4] == ["id", "object", "created", "owned_by"]
    named = (card["id"], card["object"], card["owned_by"], card["architecture"])
    assert named == (SERVED, "model", "pdserve", "gemma3")
    assert httpx.get(f"{base}/v1/models/{SERVED}", timeout=10).json()["architecture"] == "gemma3"


def test_a_chat_under_googles_name_renders_its_template_kwargs(gemma_cluster, tiny_loaded):
    endpoint = f"{gemma_cluster.router.http_url}/v1/chat/completions"
    body = {"model": SERVED, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    plain = httpx.post(endpoint, json=body, timeout=30).json()["usage"]["prompt_tokens"]
    off = httpx.post(endpoint, json=body | {"chat_template_kwargs": {"enable_thinking": False}}, timeout=30)
    assert off.status_code == 200, off.text
    think = len(tiny_loaded.tokenizer.encode("<think>\n\n</think>\n\n"))
    assert off.json()["usage"]["prompt_tokens"] == plain + think
    for kwargs, words in ((["enable_thinking"], "must be an object"), ({"messages": []}, "pdserve sets it")):
        refused = httpx.post(endpoint, json=body | {"chat_template_kwargs": kwargs}, timeout=30)
        error = refused.json()["error"]
        assert (refused.status_code, error["param"]) == (400, "chat_template_kwargs")
        assert words in error["message"]
    wait_until_clean(*gemma_cluster.workers)
