"""A raw text prompt (the completions API, `pdserve generate --raw`) is tokenized as the model's own
tokenizer does by default, special tokens included: a model that starts every text with <bos>
(Gemma) gets it, as vLLM's completions API gives it; one that adds none (SmolLM2) gets none."""

from __future__ import annotations

from pdserve.engine.tokenizer import Tokenizer
from protos.pdserve.v1 import generation_pb2
from router.service import prompt_token_ids
from tests.engine.test_spm_tokenizer import spm_metadata


def raw(text: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(text=text, raw=True)


def test_a_raw_prompt_starts_with_the_bos_the_tokenizer_adds():
    tokenizer = Tokenizer.from_gguf_metadata(spm_metadata())
    assert tokenizer.bos_token_id is not None
    assert prompt_token_ids(raw("hello world"), tokenizer) == tokenizer.encode("hello world",
                                                                               add_special_tokens=True)
    assert prompt_token_ids(raw("hello world"), tokenizer)[0] == tokenizer.bos_token_id


def test_a_tokenizer_that_adds_no_bos_gets_none(tiny_loaded):
    tokenizer = tiny_loaded.tokenizer
    ids = prompt_token_ids(raw("Hello there"), tokenizer)
    assert ids == tokenizer.encode("Hello there") and tokenizer.bos_token_id not in ids
