"""A tokenizer's vocabulary from GGUF metadata (tokenizer.ggml.*), as a `tokenizers` backend.

    metadata --gguf_vocabulary--> GgufVocabulary(backend, special token names, chat template)

Byte-level BPE (`tokenizer.ggml.model` "gpt2"): a GGUF stores only the vocabulary, the merges, the
token types and a short name for the pre-tokenizer (`tokenizer.ggml.pre`); how to split text
before BPE is implied by that name, and we follow llama.cpp's table for it (llama-vocab.cpp). That
matters: SmolLM2 ("smollm") splits every digit on its own before the GPT-2 regex, and transformers'
GGUF loader, which does not know "smollm", does not -- so "  123" encodes differently there (see
tests/engine/test_tokenizer.py).

SentencePiece ("llama"): a BPE over the pieces with byte fallback (`<0x0A>` is the byte 0x0A),
spaces normalised to "▁", and merges recovered from the vocabulary. Two forms, as
`tokenizer.ggml.add_space_prefix` says (llama.cpp reads it the same way):
- false (Gemma): no space is added; merges ranked by each piece's place in the file, as
  transformers rebuilds Gemma's.
- true or absent (Llama 2, Mistral): a "▁" goes before each run of text that starts the input or
  follows a special token, as llama.cpp's SPM tokenizer does and Llama 2's own tokenizer.json
  (Prepend("▁") per segment) does; decoding takes one leading space off. Merges ranked by
  tokenizer.ggml.scores, as transformers' GGUF conversion ranks them. NOTE: that conversion instead
  uses Metaspace(prepend_scheme="first"), which adds no "▁" after a special token nor before text
  that already starts with a space (" hi" is "▁hi" there, "▁▁hi" in SentencePiece and llama.cpp).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

logger = logging.getLogger(__name__)

GGUF_TOKEN_UNKNOWN = 2  # llama.cpp's token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte
GGUF_TOKEN_CONTROL = 3
GGUF_TOKEN_USER_DEFINED = 4
SPACE_PIECE = "\u2581"  # SentencePiece's spelling of a space: "▁"

# llama.cpp (llama-vocab.cpp): these pre-tokenizer names split each digit (\p{N}) first, then
# apply the GPT-2 regex. In `tokenizers` terms: Digits(individual) then ByteLevel(use_regex).
_DIGITS_THEN_GPT2 = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
# The plain GPT-2 regex (ByteLevel's own).
_GPT2 = frozenset({"default", "gpt-2", "gpt2", "mpt", "olmo", "jais"})
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Names whose regex replaces ByteLevel's: Split(regex, isolated) then ByteLevel(use_regex=False).
_SPLIT_REGEXES = MappingProxyType({
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
})

# Gemma's turn format, for a GGUF whose vocabulary has Gemma's turn markers but which carries no
# tokenizer.chat_template (the Gemma 3 270M base file has none). A system message opens the first
# user turn; the assistant's turns are called "model"; every turn ends with <end_of_turn>.
_GEMMA_TURN_MARKERS = ("<start_of_turn>", "<end_of_turn>")
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 is even) -%}"
    "{{ raise_exception('Gemma chats alternate user and assistant turns after one system message') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{{ (prefix if loop.first else '') + message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class GgufVocabulary:
    """What a GGUF says about its tokenizer, ready for pdserve.engine.tokenizer.Tokenizer."""

    backend: BackendTokenizer
    special_tokens: Mapping[str, str | None]  # bos, eos, unk, pad: the tokens' text
    chat_template: str | None


def gguf_vocabulary(metadata: Mapping[str, Any]) -> GgufVocabulary:
    """The tokenizer a GGUF's metadata (key -> value, as read_gguf_metadata gives it) describes."""
    tokens = [str(token) for token in _require(metadata, "tokenizer.ggml.tokens")]
    kind = metadata.get("tokenizer.ggml.model")
    special = {"bos": _gguf_token(metadata, tokens, "bos_token_id"),
               "eos": _gguf_token(metadata, tokens, "eos_token_id"),
               "unk": _gguf_token(metadata, tokens, "unknown_token_id"),
               "pad": _gguf_token(metadata, tokens, "padding_token_id")}
    if kind == "gpt2":
        backend, add_bos = _gguf_backend(metadata, tokens), False
    elif kind == "llama":
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        backend, add_bos = _gguf_sentencepiece_backend(metadata, tokens, special["unk"]), True
    else:
        raise ValueError(
            f"GGUF tokenizer.ggml.model is {kind!r}; pdserve reads byte-level BPE ('gpt2') and "
            "SentencePiece ('llama') vocabularies from GGUF. Load the model's Hugging Face directory "
            "(tokenizer.json) instead.")
    add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", add_bos)
    _set_post_processor(backend, special["bos"] if add_bos else None, special["eos"] if add_eos else None)
    return GgufVocabulary(backend, MappingProxyType(special), _gguf_chat_template(metadata, backend))


def read_gguf_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata key of a gguf.GGUFReader with its Python value (arrays as lists)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def _require(metadata: Mapping[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ValueError(f"GGUF metadata has no {key}: this file carries no usable tokenizer; "
                         "load the model's Hugging Face directory (tokenizer.json) instead")
    return metadata[key]


def _gguf_token(metadata: Mapping[str, Any], tokens: Sequence[str], key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    if token_id is None:
        return None
    if not 0 <= int(token_id) < len(tokens):
        raise ValueError(f"GGUF tokenizer.ggml.{key} is {token_id}, outside the vocabulary of {len(tokens)} "
                         "tokens; the file is damaged -- re-convert it")
    return str(tokens[int(token_id)])


def _gguf_backend(metadata: Mapping[str, Any], tokens: list[str]) -> BackendTokenizer:
    merges = _require(metadata, "tokenizer.ggml.merges")
    alphabet = byte_alphabet()
    # Tokens are stored in the byte alphabet already; respell any that are raw UTF-8 (as transformers does).
    spelled = [t if set(t) <= alphabet.keys() else _respell(t) for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}
    pairs = [tuple(str(merge).split(" ", 1)) for merge in merges]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=None, fuse_unk=False,
                                          byte_fallback=False, ignore_merges=False))
    backend.pre_tokenizer = _gguf_pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    types = list(metadata.get("tokenizer.ggml.token_type") or [])
    # Control tokens (<|im_start|>, ...) are matched whole before BPE and skipped on decode; a
    # "control" token outside the byte alphabet is a mislabel and adding it would grow the vocab.
    control = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, types) if kind == GGUF_TOKEN_CONTROL and set(t) <= alphabet.keys()]
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types) if kind == GGUF_TOKEN_USER_DEFINED and t in vocab]
    backend.add_special_tokens(control)
    backend.add_tokens(user)
    return backend


def _gguf_sentencepiece_backend(metadata: Mapping[str, Any], tokens: list[str],
                                unk: str | None) -> BackendTokenizer:
    """A SentencePiece vocabulary: Gemma's form without a prefix space, Llama 2's with one."""
    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        return _prefix_space_backend(metadata, tokens, unk)
    # A run of spaces is stored as real spaces, but the model sees the text after " " -> "▁".
    spelled = [SPACE_PIECE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=_sentencepiece_merges(vocab), unk_token=unk,
                                          fuse_unk=True, byte_fallback=True))
    # NOTE: no pre-tokenizer: once spaces are "▁" the text is one word, and merges may cross a space.
    backend.normalizer = normalizers.Replace(" ", SPACE_PIECE)
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE_PIECE, " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    _add_sentencepiece_specials(backend, metadata, tokens, vocab, (GGUF_TOKEN_CONTROL,))
    return backend


def _prefix_space_backend(metadata: Mapping[str, Any], tokens: list[str],
                          unk: str | None) -> BackendTokenizer:
    """Llama 2's form (its tokenizer.json, and llama.cpp's SPM tokenizer): "▁" before each segment of
    text between special tokens, spaces as "▁", one leading space dropped on decode."""
    vocab = {token: index for index, token in enumerate(tokens)}
    scores = metadata.get("tokenizer.ggml.scores")
    ranks = ([float(score) for score in scores] if scores is not None and len(scores) == len(tokens)
             else [-float(index) for index in range(len(tokens))])
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=_scored_merges(tokens, ranks), unk_token=unk,
                                          fuse_unk=True, byte_fallback=True))
    # NOTE: a normalizer, not a pre-tokenizer: it runs on each segment between added tokens, so the
    # "▁" also goes after a special token, and " hi" keeps its own space ("▁▁hi").
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_PIECE),
                                               normalizers.Replace(" ", SPACE_PIECE)])
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE_PIECE, " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    # <unk> is typed "unknown", not control; transformers and Llama 2's tokenizer.json make it special.
    _add_sentencepiece_specials(backend, metadata, tokens, vocab, (GGUF_TOKEN_CONTROL, GGUF_TOKEN_UNKNOWN))
    return backend


def _add_sentencepiece_specials(backend: BackendTokenizer, metadata: Mapping[str, Any], tokens: list[str],
                                vocab: Mapping[str, int], special_types: tuple[int, ...]) -> None:
    types = list(metadata.get("tokenizer.ggml.token_type") or [])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types) if kind in special_types])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, types) if kind == GGUF_TOKEN_USER_DEFINED and t in vocab])


def _scored_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """The merges a scored SentencePiece vocabulary implies, in the order transformers'
    generate_merges gives them: every cut of a piece into two pieces of the vocabulary, best score
    first, then the shorter left part, then the shorter right part."""
    vocab = {token: index for index, token in enumerate(tokens)}
    score_of = dict(zip(tokens, scores))
    merges = []
    for piece, score in score_of.items():
        cuts = [(piece[:cut], piece[cut:]) for cut in range(1, len(piece))
                if piece[:cut] in vocab and piece[cut:] in vocab]
        cuts.sort(key=lambda cut: (vocab[cut[0]], vocab[cut[1]]))
        merges.extend((left, right, score) for left, right in cuts)
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece_merges(vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: each way to cut a piece into two pieces of the
    vocabulary, ranked by the whole piece's place in the file (best first), and for one piece the cut
    with the longer left part first -- the order transformers' generate_merges gives Gemma's.

    NOTE: the place in the file, not tokenizer.ggml.scores: Gemma's scores follow the file order for
    normal pieces but give every control and user-defined piece -1000, which is not its rank."""
    merges = []
    for piece, _ in sorted(vocab.items(), key=lambda item: item[1]):
        merges.extend((piece[:cut], piece[cut:]) for cut in range(len(piece) - 1, 0, -1)
                      if piece[:cut] in vocab and piece[cut:] in vocab)
    return merges


def _gguf_chat_template(metadata: Mapping[str, Any], backend: BackendTokenizer) -> str | None:
    """The file's template; Gemma's turn format for a Gemma vocabulary that carries none."""
    template = metadata.get("tokenizer.chat_template")
    if template is None and all(backend.token_to_id(marker) is not None for marker in _GEMMA_TURN_MARKERS):
        logger.info("GGUF has no tokenizer.chat_template; its vocabulary has %s, so Gemma's turn format "
                    "is used", " and ".join(_GEMMA_TURN_MARKERS))
        return GEMMA_CHAT_TEMPLATE
    return template


def _gguf_pre_tokenizer(name: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if name is None or name in _GPT2:
        return byte_level
    if name in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if name in _SPLIT_REGEXES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_REGEXES[name]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ])
    known = sorted(_GPT2 | _DIGITS_THEN_GPT2 | _SPLIT_REGEXES.keys())
    raise ValueError(f"GGUF tokenizer.ggml.pre is {name!r}, which pdserve does not know how to split "
                     f"(known: {', '.join(known)}); load the model's Hugging Face directory instead")


def _set_post_processor(backend: BackendTokenizer, bos: str | None, eos: str | None) -> None:
    """What encode(add_special_tokens=True) adds: BOS/EOS only where the file asks for them."""
    pieces = ([bos] if bos else []) + ["$A"] + ([eos] if eos else [])
    if len(pieces) == 1:
        return
    used = {token for token in pieces if token != "$A"}
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join(pieces), special_tokens=[(token, backend.token_to_id(token)) for token in used])


def byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte (character -> byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + extra)
            extra += 1
    return {char: byte for byte, char in chars.items()}




def _respell(token: str) -> str:
    to_char = {byte: char for char, byte in byte_alphabet().items()}
    return "".join(to_char[byte] for byte in token.encode("utf-8"))
