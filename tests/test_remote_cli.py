"""`pdserve generate --router` and `pdserve chat` against the in-process Generation test double."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import grpc
import pytest

from deploy import cli
from pdserve.client import USAGE_FIELDS
from tests.test_client import TIMINGS, USAGE, FakeGeneration, closed_port_target, serving

UNREACHABLE = "UNAVAILABLE: cannot reach the router at {}; is `pdserve up` running?\n"


@pytest.fixture
def fake() -> FakeGeneration:
    return FakeGeneration()


@pytest.fixture
def target(fake) -> Iterator[str]:
    with serving(fake) as t:
        yield t


def messages_of(request) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in request.chat.messages]


# --- generate --router --------------------------------------------------------------------------

def test_generate_streams_the_text_to_stdout(target, fake, capsys):
    assert cli.main(["generate", "--router", target, "What is the capital of France?"]) == 0
    assert capsys.readouterr().out == "Hello, world\n"
    (request,) = fake.requests
    assert request.WhichOneof("prompt") == "text" and request.text == "What is the capital of France?"
    assert not request.raw
    s = request.sampling
    assert s.max_tokens == 128
    # no sampling flag given: nothing sent, so the router's defaults (the served model's) apply
    assert not any(s.HasField(name) for name in ("temperature", "top_k", "top_p", "seed"))


def test_generate_sends_the_sampling_flags_given_zero_included(target, fake, capsys):
    assert cli.main(["generate", "--router", target, "--temperature", "0", "--top-k", "0", "hi"]) == 0
    s = fake.requests[0].sampling
    assert s.HasField("temperature") and s.temperature == 0 and s.HasField("top_k") and s.top_k == 0
    assert not s.HasField("top_p")


def test_generate_json_prints_one_object(target, capsys):
    assert cli.main(["generate", "--router", target, "--json", "--temperature", "0", "hi"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"text": "Hello, world", "token_ids": [1, 2, 3], "finish_reason": "length",
                   "usage": USAGE, "timings": TIMINGS}


def test_generate_prompt_flags_shape_the_request(target, fake, capsys):
    assert cli.main(["generate", "--router", target, "--system", "Be brief.", "hi"]) == 0
    assert cli.main(["generate", "--router", target, "--raw", "--stop", "\n", "--seed", "7", "hi"]) == 0
    assert cli.main(["generate", "--router", target, "--token-ids", "1,2,3"]) == 0
    chat, raw, ids = fake.requests
    assert messages_of(chat) == [("system", "Be brief."), ("user", "hi")]
    assert raw.raw and raw.text == "hi" and list(raw.sampling.stop) == ["\n"] and raw.sampling.seed == 7
    assert list(ids.token_ids.ids) == [1, 2, 3]


def test_generate_error_prints_the_status_and_exits_1(target, capsys):
    assert cli.main(["generate", "--router", target, "--max-tokens", "0", "hi"]) == 1
    captured = capsys.readouterr()
    assert captured.err == "INVALID_ARGUMENT: max_tokens must be >= 1\n"
    assert "Traceback" not in captured.err


def test_generate_unreachable_router(capsys):
    target = closed_port_target()
    assert cli.main(["generate", "--router", target, "hi"]) == 1
    assert capsys.readouterr().err == UNREACHABLE.format(target)


def test_generate_input_jsonl_prints_one_result_per_line(target, fake, tmp_path, capsys):
    lines = [{"prompt": "a"}, {"token_ids": [4, 5], "max_tokens": 0},
             {"messages": [{"role": "user", "content": "b"}], "max_tokens": 9, "seed": 1},
             {"prompt": "c", "temprature": 0}]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert cli.main(["generate", "--router", target, "--max-tokens", "5", "--input", str(path)]) == 1
    first, bad, chat, typo = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert first["text"] == "Hello, world" and set(first["usage"]) == set(USAGE_FIELDS)
    assert bad == {"error": "INVALID_ARGUMENT: max_tokens must be >= 1", "code": "INVALID_ARGUMENT",
                   "line": 2}
    assert chat["token_ids"] == [1, 2, 3]
    assert typo["line"] == 4 and "unknown field(s) temprature" in typo["error"]
    sent = fake.requests
    assert len(sent) == 3 and sent[0].sampling.max_tokens == 5  # the flag, unless a line overrides it
    assert (sent[2].sampling.max_tokens, sent[2].sampling.seed) == (9, 1)


def test_generate_rejects_flags_that_only_apply_locally(target, capsys):
    assert cli.main(["generate", "--router", target, "--model", "/m", "hi"]) == 2
    assert "--model applies to --local only" in capsys.readouterr().err
    assert cli.main(["generate", "--router", target]) == 2
    assert "no prompt" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--router", target, "--local", "hi"])
    assert "not allowed with argument" in capsys.readouterr().err


# --- chat ---------------------------------------------------------------------------------------

def chat(monkeypatch, *argv: str, stdin: str) -> int:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    return cli.main(["chat", *argv])


def test_chat_keeps_the_whole_history(target, fake, monkeypatch, capsys):
    rc = chat(monkeypatch, "--router", target, "--system", "Be brief.", "--max-tokens", "16",
              stdin="Hi there\nAnd then?\n")
    assert rc == 0
    first, second = fake.requests
    assert messages_of(first) == [("system", "Be brief."), ("user", "Hi there")]
    assert messages_of(second) == [("system", "Be brief."), ("user", "Hi there"),
                                   ("assistant", "Hello, world"), ("user", "And then?")]
    assert second.sampling.max_tokens == 16
    assert not any(second.sampling.HasField(name) for name in ("temperature", "top_k", "top_p"))
    captured = capsys.readouterr()
    assert captured.out.count("you> ") == 3 and captured.out.count("Hello, world\n") == 2
    assert ("[turn 2: 143 prompt tokens, 128 cached, 15 computed, 3 generated · ttft 85 ms · "
            "decode worker d0]") in captured.err


def test_chat_reset_and_exit(target, fake, monkeypatch, capsys):
    rc = chat(monkeypatch, "--router", target, stdin="one\n/reset\n\ntwo\n/exit\nnever sent\n")
    assert rc == 0
    assert [messages_of(r) for r in fake.requests] == [[("user", "one")], [("user", "two")]]
    assert "(history cleared)" in capsys.readouterr().err


def test_chat_failed_turn_is_not_added_to_the_history(target, fake, monkeypatch, capsys):
    fake.fail_next = (grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks")
    assert chat(monkeypatch, "--router", target, stdin="one\ntwo\n") == 0
    assert [messages_of(r) for r in fake.requests] == [[("user", "one")], [("user", "two")]]
    assert "RESOURCE_EXHAUSTED: no free KV blocks" in capsys.readouterr().err


def test_chat_unreachable_router(monkeypatch, capsys):
    target = closed_port_target()
    assert chat(monkeypatch, "--router", target, stdin="hi\n") == 1
    assert UNREACHABLE.format(target) in capsys.readouterr().err
