"""chat_template_kwargs (vLLM's): the chat request's object of extra template variables reaches the
chat template the router renders; anything but an object is a 400 naming the field. Pure: no server."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.tokenizer import Tokenizer
from protos.pdserve.v1 import generation_pb2 as pb
from router.http.errors import ApiError
from router.http.protocol import parse_chat
from router.service import InvalidPrompt, prompt_token_ids

MODEL = "SmolLM2-135M-Instruct"
# Qwen3's switch, cut down: with enable_thinking false the assistant turn opens with an empty think block.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def thinking_tokenizer(tiny_loaded, tmp_path_factory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("thinking-template")
    tiny_loaded.tokenizer.save(directory, chat_template=THINKING_TEMPLATE)
    return Tokenizer.from_files(directory)


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": MESSAGES, **fields}


def test_the_kwargs_travel_as_a_json_object_and_none_as_nothing():
    api = parse_chat(chat(chat_template_kwargs={"enable_thinking": False, "depth": 1}), MODEL)
    text = api.generate.chat.chat_template_kwargs
    assert json.loads(text) == {"enable_thinking": False, "depth": 1} and '"depth": 1' in text  # 1 stays 1
    assert parse_chat(chat(), MODEL).generate.chat.chat_template_kwargs == ""
    assert parse_chat(chat(chat_template_kwargs={}), MODEL).generate.chat.chat_template_kwargs == ""


@pytest.mark.parametrize("value", [["enable_thinking"], "enable_thinking=false", 1, True])
def test_anything_but_an_object_is_a_400_naming_the_field(value):
    with pytest.raises(ApiError) as e:
        parse_chat(chat(chat_template_kwargs=value), MODEL)
    assert (e.value.status, e.value.param) == (400, "chat_template_kwargs")
    assert "must be an object" in e.value.message


def test_the_router_renders_the_template_with_them(thinking_tokenizer):
    off = prompt_token_ids(parse_chat(chat(chat_template_kwargs={"enable_thinking": False}), MODEL).generate,
                           thinking_tokenizer)
    plain = prompt_token_ids(parse_chat(chat(), MODEL).generate, thinking_tokenizer)
    on = prompt_token_ids(parse_chat(chat(chat_template_kwargs={"enable_thinking": True}), MODEL).generate,
                          thinking_tokenizer)
    assert plain == on and off[:len(plain)] == plain
    assert thinking_tokenizer.decode(off[len(plain):], skip_special_tokens=False) == "<think>\n\n</think>\n\n"
    assert off == thinking_tokenizer.apply_chat_template(MESSAGES, enable_thinking=False)


@pytest.mark.parametrize("text, words", [
    ('{"messages": []}', "chat_template_kwargs.messages: pdserve sets it"),
    ('{"add_generation_prompt": false}', "chat_template_kwargs.add_generation_prompt"),
    ("[1]", "must be a JSON object, got list"),
    ("{", "not valid JSON"),
])
def test_a_grpc_caller_gets_invalid_prompt_for_a_bad_object(thinking_tokenizer, text, words):
    request = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")],
                                                      chat_template_kwargs=text))
    with pytest.raises(InvalidPrompt, match=words):
        prompt_token_ids(request, thinking_tokenizer)
