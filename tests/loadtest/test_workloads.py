"""loadtest.workloads: reproducible by seed, lengths within bounds, turns that build on each other."""

from __future__ import annotations

import random

import pytest

from loadtest.workloads import (
    TOKEN_ID_RANGE,
    WORDS,
    WORKLOADS,
    ConversationHistory,
    LongDoc,
    Mixed,
    MultiTurn,
    SharedPrefix,
    Synthetic,
    make_workload,
    parse_params,
    words,
)


def specs(workload, count=40, seed=0):
    return list(workload.requests(count, random.Random(seed)))


def content_words(spec) -> int:
    return sum(len(m["content"].split()) for m in spec.messages)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_same_seed_same_requests_other_seed_other_requests(name):
    workload = make_workload(name)
    assert specs(workload, seed=3) == specs(workload, seed=3)
    assert specs(workload, seed=3) != specs(workload, seed=4)
    assert [s.index for s in specs(workload, count=10)] == list(range(10))


def test_synthetic_lengths_stay_within_the_range_ratio():
    out = specs(Synthetic(input_tokens=100, output_tokens=20, range_ratio=0.5), count=200)
    assert all(50 <= content_words(s) <= 150 and 10 <= s.max_tokens <= 30 for s in out)
    assert len({content_words(s) for s in out}) > 10  # it does vary
    fixed = specs(Synthetic(input_tokens=64, output_tokens=8))
    assert {content_words(s) for s in fixed} == {64} and {s.max_tokens for s in fixed} == {8}


def test_synthetic_token_ids_are_exact_lengths_in_range():
    out = specs(Synthetic(input_tokens=32, output_tokens=4, token_ids=True))
    assert all(len(s.token_ids) == 32 and not s.messages for s in out)
    assert all(TOKEN_ID_RANGE[0] <= t < TOKEN_ID_RANGE[1] for s in out for t in s.token_ids)


def test_shared_prefix_requests_share_their_system_prompt():
    out = specs(SharedPrefix(system_prompt_tokens=50, num_prefixes=2, question_tokens=5), count=40)
    systems = {s.messages[0]["content"] for s in out}
    assert len(systems) == 2 and all(len(p.split()) == 50 for p in systems)
    assert all(s.messages[0]["role"] == "system" and content_words(s) == 55 for s in out)
    assert len({s.messages[1]["content"] for s in out}) == 40  # the questions differ


def test_long_doc_questions_ask_about_one_of_the_documents():
    out = specs(LongDoc(num_docs=3, doc_tokens=300, question_tokens=8), count=30)
    docs = {s.messages[0]["content"].split("\n\nQuestion:")[0] for s in out}
    assert len(docs) == 3
    assert all(len(d.removeprefix("Document:\n").split()) == 300 for d in docs)


def test_mixed_has_long_prompts_with_short_answers_and_short_prompts_with_long_answers():
    out = specs(Mixed(), count=200)
    long, short = [s for s in out if s.kind == "long"], [s for s in out if s.kind == "short"]
    assert len(long) + len(short) == 200 and 70 <= len(long) <= 130
    assert all(1000 <= content_words(s) <= 1500 and 4 <= s.max_tokens <= 8 for s in long)
    assert all(content_words(s) == 30 and 64 <= s.max_tokens <= 128 for s in short)
    sized = specs(Mixed(long_fraction=1.0, long_prompt_min=10, long_prompt_max=10, token_ids=True))
    assert all(len(s.token_ids) == 10 and s.kind == "long" for s in sized)


def test_mixed_rejects_an_empty_range():
    with pytest.raises(ValueError, match="long_prompt_min <= long_prompt_max"):
        Mixed(long_prompt_min=20, long_prompt_max=10)


def test_multi_turn_orders_turns_round_robin_over_conversations():
    out = specs(MultiTurn(turns=3, turn_tokens=5, output_tokens=4), count=7)
    # ceil(7 / 3) = 3 conversations; every first turn, then every second, then one third turn
    assert [(s.conversation, s.turn) for s in out] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 2)]
    assert all(len(s.messages) == 1 and s.messages[0]["role"] == "user" for s in out)


def test_multi_turn_turns_build_on_each_other():
    out = specs(MultiTurn(turns=3, turn_tokens=5, output_tokens=4, system_prompt_tokens=6), count=3)
    first, second, third = out  # conversation 0 only: count 3 = 1 conversation of 3 turns
    history = ConversationHistory()
    sent_first = history.messages_for(first)
    assert [m["role"] for m in sent_first] == ["system", "user"]
    history.record_reply(first, "first answer")
    sent_second = history.messages_for(second)
    assert sent_second == [*sent_first, {"role": "assistant", "content": "first answer"}, *second.messages]
    history.record_reply(second, "second answer")
    sent_third = history.messages_for(third)
    assert sent_third[:len(sent_second)] == sent_second
    assert [m["role"] for m in sent_third] == ["system", "user", "assistant", "user", "assistant", "user"]


def test_make_workload_converts_string_params_and_rejects_unknown_ones():
    params = parse_params(["input_tokens=12", "range_ratio=0.25", "token_ids=true"])
    assert make_workload("synthetic", params) == Synthetic(input_tokens=12, range_ratio=0.25, token_ids=True)
    with pytest.raises(ValueError, match="has no parameter 'input_len'"):
        make_workload("synthetic", {"input_len": "3"})
    with pytest.raises(ValueError, match="input_tokens takes an integer, got 'many'"):
        make_workload("synthetic", {"input_tokens": "many"})
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("chat")
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_params(["input_tokens"])


def test_each_word_is_one_token_for_the_default_model():
    from pdserve.engine.weights import load_tokenizer

    tokenizer = load_tokenizer()
    assert all(len(tokenizer.encode(" " + w)) == 1 for w in WORDS)
    text = words(random.Random(0), 500)
    assert len(tokenizer.encode(text)) == 500
