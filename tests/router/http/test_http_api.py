"""The HTTP front door over a real router and workers (tiny model, real sockets), driven with raw HTTP
(httpx): every error row of OpenAI's shape with its status, auth, health, metrics, streaming shape,
and greedy parity with gRPC and the engine. Every flow ends with the leak check. The SmolLM2 cluster
from `pdserve up`, driven with the official openai SDK, is tests/cluster/test_openai_api.py."""

from __future__ import annotations

import json
import ssl
from dataclasses import replace

import httpx
import pytest

from pdserve.engine.sequence import SamplingParams
from pdserve.metrics import scrape
from pdserve.security import SecurityConfig
from pdserve.worker.server import WorkerConfig
from tests.conftest import make_engine
from tests.helpers.cluster import generate, generate_request, metric_value, running_cluster, start_router
from tests.helpers.workers import wait_until_clean

MODEL = "pdserve"  # RouterConfig's default served_model_name
PROMPT = list(range(300, 340))  # 40 tokens: prefilled remotely (min_remote_prefill_tokens 32)
TOKEN = "api-token-http-1"


@pytest.fixture(scope="module")
def cluster(tiny_loaded):
    # 16 blocks of 16 tokens: a 300-token prompt fits the 512-token context but no KV pool (429)
    with running_cluster(tiny_loaded, num_blocks=16, http_port=0, metrics_port=0) as c:
        yield c


def url(cluster, path: str) -> str:
    return cluster.router.http_url + path


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **fields}


def sse_events(response: httpx.Response) -> list:
    """The data of every server-sent event, JSON-decoded except the final [DONE]."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize("method, path, body, status, param, words", [
    ("POST", "/v1/completions", completion(max_tokens=5000), 400, "max_tokens", "limit of 4,096"),
    ("POST", "/v1/completions", completion(stop=["x"] * 17), 400, "stop", "limit is 16"),
    ("POST", "/v1/completions", completion(prompt=[60000]), 400, "prompt", "outside the vocabulary"),
    ("POST", "/v1/completions", completion(top_p=0), 400, "top_p", "top_p must be in (0, 1]"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages", "non-empty list"),
    ("POST", "/v1/completions", "{not json", 400, None, "not valid JSON"),
    ("POST", "/v1/completions", completion(model="gpt-4o"), 404, "model", "this server serves 'pdserve'"),
    ("GET", "/v1/models/gpt-4o", None, 404, "model", "does not exist here"),
    ("GET", "/v2/anything", None, 404, None, "no route GET /v2/anything"),
    ("POST", "/v1/completions", completion(prompt=list(range(300, 600))), 429, None, "KV pool holds 256"),
])
def test_each_error_has_its_status_and_openai_body_and_leaks_nothing(cluster, method, path, body, status,
                                                                     param, words):
    content = body if isinstance(body, str) else None
    response = httpx.request(method, url(cluster, path), json=None if content else body, content=content,
                             timeout=30)
    error = response.json()["error"]
    assert response.status_code == status, error
    assert set(error) == {"message", "type", "param", "code"} and words in error["message"]
    assert error["param"] == param
    if status == 429:
        assert int(response.headers["Retry-After"]) >= 1
    wait_until_clean(*cluster.workers)


def test_no_live_decode_worker_is_503_and_health_says_so(tiny_loaded):
    router = start_router(tiny_loaded, [], http_port=0)
    try:
        response = httpx.post(router.http_url + "/v1/completions", json=completion(), timeout=30)
        health = httpx.get(router.http_url + "/health", timeout=30)
    finally:
        router.stop()
    assert response.status_code == 503 and "no live decode worker" in response.json()["error"]["message"]
    assert health.status_code == 503 and health.json()["error"]["type"] == "service_unavailable_error"


def test_a_missing_or_wrong_token_is_401_and_health_and_metrics_stay_open(tiny_loaded):
    security = SecurityConfig(api_tokens=(TOKEN,))
    with running_cluster(tiny_loaded, http_port=0, security=security) as c:
        missing = httpx.post(url(c, "/v1/completions"), json=completion(), timeout=30)
        wrong = httpx.post(url(c, "/v1/completions"), json=completion(),
                           headers={"Authorization": "Bearer not-the-token"}, timeout=30)
        models = httpx.get(url(c, "/v1/models"), timeout=30)
        right = httpx.post(url(c, "/v1/completions"), json=completion(),
                           headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        open_paths = [httpx.get(url(c, p), timeout=30).status_code for p in ("/health", "/metrics")]
        wait_until_clean(*c.workers)
    assert [r.status_code for r in (missing, wrong, models, right)] == [401, 401, 401, 200]
    assert "Authorization: Bearer" in missing.json()["error"]["message"]
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    assert open_paths == [200, 200]


def test_greedy_tokens_over_http_equal_grpc_and_the_engine(cluster, tiny_loaded):
    expected = make_engine(tiny_loaded).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), detokenize=False)[0].token_ids
    endpoint = url(cluster, "/v1/completions")
    whole = httpx.post(endpoint, json=completion(return_token_ids=True), timeout=30).json()
    with httpx.stream("POST", endpoint, timeout=30, json=completion(return_token_ids=True, stream=True)) as r:
        streamed = [t for e in sse_events(r)[:-1] for c in e["choices"] for t in c.get("token_ids", [])]
    over_grpc = [t for r in generate(cluster.router, generate_request(PROMPT, 6)) for t in r.token_ids]
    assert whole["choices"][0]["token_ids"] == streamed == over_grpc == expected
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"] == {"prompt_tokens": 40, "completion_tokens": 6, "total_tokens": 46,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    wait_until_clean(*cluster.workers)


def test_a_chat_stream_opens_with_the_role_ends_with_finish_reason_usage_and_done(cluster):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url(cluster, "/v1/chat/completions"), json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    first, *middle, finish, usage, done = events
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and e["choices"][0]["finish_reason"] is None
               for e in [first, *middle])
    assert finish["choices"][0]["finish_reason"] == "length" and finish["pdserve"]["decode_worker"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert done == "[DONE]"
    wait_until_clean(*cluster.workers)


def test_metrics_over_http_are_the_registry_grpc_calls_count_in(cluster):
    def ok_requests() -> float:
        return metric_value(scrape(url(cluster, "/metrics")), "pdserve_router_requests_total", code="OK")

    before = ok_requests()
    generate(cluster.router, generate_request(PROMPT, 2))
    httpx.post(url(cluster, "/v1/completions"), json=completion(max_tokens=2), timeout=30)
    assert ok_requests() == before + 2
    models = httpx.get(url(cluster, "/v1/models"), timeout=30).json()
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(MODEL, 512)]


def test_with_a_certificate_the_http_api_is_served_over_tls_with_the_same_tokens(tiny_loaded, dev_certs):
    inside = SecurityConfig(tls=dev_certs.server_tls(), cluster_secret="cluster-secret-http-2")
    workers = [WorkerConfig(role, metrics_port=None, security=inside) for role in ("prefill", "decode")]
    with running_cluster(tiny_loaded, workers=workers, http_port=0,
                         security=replace(inside, api_tokens=(TOKEN,))) as c:
        assert c.router.http_url.startswith("https://")
        with httpx.Client(verify=ssl.create_default_context(cafile=dev_certs.ca), timeout=30) as client:
            answer = client.post(url(c, "/v1/completions"), json=completion(),
                                 headers={"Authorization": f"Bearer {TOKEN}"})
        with pytest.raises(httpx.HTTPError):  # plaintext HTTP to the TLS port
            httpx.post(url(c, "/v1/completions").replace("https://", "http://"), json=completion(), timeout=5)
        wait_until_clean(*c.workers)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 6
