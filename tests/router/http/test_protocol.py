"""OpenAI bodies -> GenerateRequest (router/http/protocol.py), and gRPC statuses -> OpenAI errors
(router/http/errors.py): pure, no server."""

from __future__ import annotations

import grpc
import pytest

from router.http.errors import ApiError
from router.http.protocol import parse_chat, parse_completion

MODEL = "SmolLM2-135M-Instruct"


def chat(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def test_chat_maps_every_sampling_field_and_the_extensions():
    api = parse_chat(chat(max_completion_tokens=7, max_tokens=99, temperature=0.5, top_p=0.9, seed=3,
                          stop="END", top_k=40, ignore_eos=True, stream=True,
                          stream_options={"include_usage": True}, logprobs=True, top_logprobs=4,
                          n=1, user="u1"), MODEL)
    s = api.generate.sampling
    got = (s.max_tokens, s.temperature, s.top_p, s.seed, list(s.stop), s.top_k, s.ignore_eos, s.logprobs)
    assert got == (7, 0.5, pytest.approx(0.9), 3, ["END"], 40, True, 4)
    assert (api.stream, api.include_usage, api.logprobs, api.kind) == (True, True, 4, "chat")


def test_unset_sampling_fields_stay_unset_so_the_server_defaults_apply():
    s = parse_chat(chat(), MODEL).generate.sampling
    assert not any(s.HasField(f) for f in ("temperature", "top_p", "top_k", "seed", "max_tokens", "logprobs"))


def test_content_parts_are_joined_and_roles_kept():
    body = chat(messages=[{"role": "system", "content": [{"type": "text", "text": "Be "},
                                                          {"type": "text", "text": "brief."}]},
                          {"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}])
    messages = parse_chat(body, MODEL).generate.chat.messages
    got = [(m.role, m.content) for m in messages]
    assert got == [("system", "Be brief."), ("user", "Hi"), ("assistant", "")]


def test_completion_prompts_string_raw_and_token_ids():
    text = parse_completion({"model": MODEL, "prompt": "Once"}, MODEL).generate
    ids = parse_completion({"model": MODEL, "prompt": [1, 2, 3], "logprobs": 2}, MODEL)
    assert (text.text, text.raw) == ("Once", True)
    assert list(ids.generate.token_ids.ids) == [1, 2, 3] and ids.logprobs == 2


@pytest.mark.parametrize("parse, body, param, words", [
    (parse_chat, chat(n=2), "n", "n must be 1"),
    (parse_chat, chat(temperature="hot"), "temperature", "finite number"),
    (parse_chat, chat(max_tokens=0), "max_tokens", "integer >= 1"),
    (parse_chat, chat(seed=-1), "seed", "integer >= 0"),
    (parse_chat, chat(stop=["", "x"]), "stop", "non-empty"),
    (parse_chat, chat(messages=[]), "messages", "non-empty list"),
    (parse_chat, chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].role",
     "system, user, assistant"),
    (parse_chat, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     "messages[0].content[0]", "text only"),
    (parse_chat, chat(top_logprobs=3), "top_logprobs", "needs logprobs: true"),
    (parse_chat, chat(stream_options={"include_usage": True}), "stream_options", "needs stream: true"),
    (parse_chat, chat(tools=[{"type": "function"}]), "tools", "not supported"),
    (parse_chat, chat(presence_penalty=0.5), "presence_penalty", "must be 0"),
    (parse_chat, chat(temprature=0.1), "temprature", "unknown field"),
    (parse_chat, {"messages": [{"role": "user", "content": "x"}]}, "model", "model is required"),
    (parse_completion, {"model": MODEL, "prompt": "x", "echo": True}, "echo", "echo must be false"),
    (parse_completion, {"model": MODEL, "prompt": ["a", "b"]}, "prompt", "separate requests"),
    (parse_completion, {"model": MODEL, "prompt": [1, -2]}, "prompt", ">= 0"),
    (parse_completion, {"model": MODEL, "prompt": "x", "logprobs": True}, "logprobs", "integer >= 0"),
])
def test_bad_fields_are_400_naming_the_field(parse, body, param, words):
    with pytest.raises(ApiError) as err:
        parse(body, MODEL)
    assert (err.value.status, err.value.param) == (400, param) and words in err.value.message
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def test_an_unknown_model_is_404_naming_the_served_one():
    with pytest.raises(ApiError) as err:
        parse_chat(chat(model="gpt-4"), MODEL)
    assert (err.value.status, err.value.code, err.value.param) == (404, "model_not_found", "model")
    assert MODEL in err.value.message


@pytest.mark.parametrize("code, status", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.UNAUTHENTICATED, 401),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 500)])
def test_grpc_statuses_map_to_the_http_statuses_openai_clients_expect(code, status):
    assert ApiError.from_status(code, "x").status == status


def test_429_carries_retry_after_in_whole_seconds_and_400_names_the_openai_field():
    full = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ApiError.from_status(full, "full", 0.25).headers() == {"Retry-After": "1"}
    assert ApiError.from_status(full, "full", 2.5).headers() == {"Retry-After": "3"}
    message = "sampling.stop has 17 strings; this server's limit is 16"
    error = ApiError.from_status(grpc.StatusCode.INVALID_ARGUMENT, message)
    assert error.param == "stop"
