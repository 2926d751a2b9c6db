"""loadtest/openai_protocol.py: request bodies, streamed chunks -> a Reply, error responses."""

from __future__ import annotations

import json

from loadtest.openai_protocol import StreamReader, error_status, model_ids, request_body
from loadtest.transport import GenerationRequest, ReplyBuilder, Sampling


class Clock:
    """now() is whatever the test set last."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_request(**overrides) -> GenerationRequest:
    fields = {"request_id": "loadtest-0-3", "sampling": Sampling(max_tokens=4),
              "messages": ({"role": "user", "content": "hi"},)}
    return GenerationRequest(**{**fields, **overrides})


def chunk(**choice) -> str:
    return json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk",
                       "choices": [{"index": 0, "finish_reason": None, **choice}]})


USAGE = json.dumps({"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
                                             "prompt_tokens_details": {"cached_tokens": 16}}})
EXTENSION = {"prefill_worker": "prefill-0", "decode_worker": "decode-1", "computed_tokens": 24,
             "timings": {"queue_ms": 0.5, "prefill_ms": 9.0, "transfer_ms": 1.5, "ttft_ms": 12.0}}


def read(events: list[tuple[float, str]], clock: Clock | None = None):
    clock = clock or Clock()
    reply = ReplyBuilder(clock)
    reply.sent()
    reader = StreamReader(reply)
    for at, data in events:
        clock.t = at
        reader.event(data, at)
    return reader.result()


def test_chat_messages_go_to_chat_completions_streamed_with_usage_and_every_sampling_field():
    sampling = Sampling(max_tokens=8, temperature=0.7, top_p=0.9, top_k=20, seed=5, stop=("\n\n", "END"),
                        ignore_eos=True)
    path, body = request_body(make_request(sampling=sampling), "SmolLM2-135M-Instruct")
    assert path == "/v1/chat/completions"
    assert body == {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
                    "temperature": 0.7, "top_p": 0.9, "seed": 5, "stop": ["\n\n", "END"], "top_k": 20,
                    "ignore_eos": True}


def test_token_ids_go_to_completions_and_unset_fields_and_extensions_stay_out():
    path, body = request_body(make_request(messages=(), token_ids=(5, 6, 7)), "m")
    assert path == "/v1/completions"
    assert body == {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4, "stream": True,
                    "stream_options": {"include_usage": True}}
    _, greedy = request_body(make_request(sampling=Sampling(max_tokens=4, temperature=0.0)), "m")
    assert greedy["temperature"] == 0.0


def test_a_chat_stream_times_each_content_chunk_and_reads_usage_and_the_extension():
    reply = read([(0.10, chunk(delta={"role": "assistant", "content": ""})),
                  (0.30, chunk(delta={"content": "Hello"})),
                  (0.35, chunk(delta={"content": " there"})),
                  (0.45, chunk(delta={"content": "!"})),
                  (0.46, json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                                     "pdserve": EXTENSION})),
                  (0.47, USAGE), (0.48, "[DONE]")])
    assert reply.ok and reply.text == "Hello there!" and reply.finish_reason == "length"
    assert reply.token_times_s == (0.30, 0.35, 0.45) and reply.token_counts == (1, 1, 1)  # not the role chunk
    assert reply.send_s == 0.0 and reply.end_s == 0.48
    assert reply.usage == {"prompt_tokens": 40, "completion_tokens": 3, "cached_tokens": 16,
                           "computed_tokens": 24}
    assert reply.server_timings_ms == EXTENSION["timings"]
    assert (reply.prefill_worker, reply.decode_worker) == ("prefill-0", "decode-1")


def test_a_plain_openai_stream_without_the_extension_or_cached_tokens_is_ok():
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}})
    reply = read([(0.2, json.dumps({"choices": [{"index": 0, "text": "x", "finish_reason": None}]})),
                  (0.3, json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})),
                  (0.4, usage), (0.5, "[DONE]")])
    assert reply.ok and reply.token_times_s == (0.2,) and reply.text == "x"
    assert reply.usage == {"prompt_tokens": 9, "completion_tokens": 1}
    assert reply.server_timings_ms is None and reply.prefill_worker is None and reply.decode_worker is None


def test_a_chunk_that_carries_token_ids_counts_them_and_one_that_carries_several_tokens_of_text_counts_one():
    reply = read([(0.1, chunk(delta={"content": "ab"}, token_ids=[1, 2])),
                  (0.2, chunk(delta={"content": "cd"})),
                  (0.3, chunk(delta={}, finish_reason="stop")), (0.4, "[DONE]")])
    assert reply.token_counts == (2, 1)


def test_tokens_that_sent_no_chunk_join_the_last_token_message_so_totals_match_usage():
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5}})
    reply = read([(0.1, chunk(delta={"content": "Hi"})), (0.2, chunk(delta={"content": "\n"})),  # 2 of 5
                  (0.3, chunk(delta={}, finish_reason="length")), (0.4, usage), (0.5, "[DONE]")])
    assert reply.ok and reply.token_times_s == (0.1, 0.2) and reply.token_counts == (1, 4)


def test_an_error_event_mid_stream_fails_the_request_with_the_servers_message():
    error = json.dumps({"error": {"message": "decode worker lost", "type": "service_unavailable_error",
                                  "param": None, "code": "unavailable"}})
    reply = read([(0.1, chunk(delta={"content": "a"})), (0.2, error), (0.3, "[DONE]")])
    assert reply.status == "STREAM_ERROR" and reply.error == "service_unavailable_error: decode worker lost"
    assert reply.token_counts == (1,)  # what arrived before the error is kept


def test_a_stream_that_breaks_off_is_incomplete_and_a_non_json_event_is_a_bad_response():
    no_done = read([(0.1, chunk(delta={"content": "a"})), (0.2, chunk(delta={}, finish_reason="stop"))])
    assert no_done.status == "INCOMPLETE_STREAM" and "data: [DONE]" in no_done.error
    no_finish = read([(0.1, chunk(delta={"content": "a"})), (0.2, "[DONE]")])
    assert no_finish.status == "INCOMPLETE_STREAM" and "finish_reason" in no_finish.error
    bad = read([(0.1, "not json"), (0.2, "[DONE]")])
    assert bad.status == "BAD_RESPONSE" and "not json" in bad.error


def test_error_responses_are_named_by_http_status_with_the_openai_message_and_retry_after():
    body = json.dumps({"error": {"message": "too many streams", "type": "rate_limit_error", "param": None,
                                 "code": "resource_exhausted"}})
    assert error_status(429, body, "2") == ("HTTP 429", "rate_limit_error: too many streams (Retry-After: 2)")
    assert error_status(502, "<html>Bad Gateway</html>") == ("HTTP 502", "<html>Bad Gateway</html>")
    assert error_status(500, "") == ("HTTP 500", "(empty body)")


def test_model_ids_reads_the_openai_model_list():
    assert model_ids({"object": "list", "data": [{"id": "a"}, {"id": "b"}]}) == ["a", "b"]
