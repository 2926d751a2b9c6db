"""Tokenizer and chat template: byte-level BPE (GPT-2 style) and SentencePiece (Gemma) vocabularies.

Two sources end in the same object, a `tokenizers.Tokenizer` plus the chat template and the
names of the special tokens:

    GGUF metadata (tokenizer.ggml.*) --from_gguf_metadata--+
                                                           +--> Tokenizer: encode / decode /
    HF directory (tokenizer.json, tokenizer_config.json) --+    render_chat / apply_chat_template

A GGUF's vocabulary is rebuilt by gguf_vocab.py (byte-level BPE, and SentencePiece as Gemma
stores it). Pieces are read back to bytes by their spelling (`token_bytes`): GPT-2's alphabet byte
by byte; in SentencePiece "▁" is a space and `<0xNN>` one byte, so a character split over byte
pieces is held back until whole (the decoder gives U+FFFD until then).

The chat template is rendered the way transformers' apply_chat_template renders it: a sandboxed
jinja2 environment with trim_blocks/lstrip_blocks, the same globals and filters, and the special
token names as variables; the result is encoded with no extra special tokens.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from pdserve.engine.gguf_vocab import SPACE_PIECE, byte_alphabet, gguf_vocabulary, read_gguf_metadata

# Tokens that end a turn in common chat formats. One counts as an end-of-sequence id when it is a
# special token of this vocabulary and the chat template writes it.
_TURN_TERMINATORS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


class PieceSpelling(enum.Enum):
    """How a vocabulary spells the bytes of its pieces (read from the backend's decoder)."""

    BYTE_LEVEL = "byte_level"  # GPT-2's printable alphabet, one character per byte
    SENTENCEPIECE = "sentencepiece"  # text with "▁" for a space, plus <0xNN> byte-fallback pieces
    OTHER = "other"  # anything else: a piece is what it decodes to alone


@dataclass(frozen=True)
class SpecialTokens:
    """The named special tokens, as text (the chat template sees them under these names)."""

    bos: str | None = None
    eos: str | None = None
    unk: str | None = None
    pad: str | None = None

    def template_variables(self) -> dict[str, str]:
        names = {"bos_token": self.bos, "eos_token": self.eos, "unk_token": self.unk, "pad_token": self.pad}
        return {name: value for name, value in names.items() if value is not None}


class Tokenizer:
    """Text <-> token ids, plus the model's chat template. Immutable once built."""

    def __init__(self, backend: BackendTokenizer, *, chat_template: str | None = None,
                 special_tokens: SpecialTokens | None = None) -> None:
        special_tokens = special_tokens or SpecialTokens()
        self._backend = backend
        self._special_tokens = special_tokens
        self._chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template else None
        self._special_ids = frozenset(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special)
        self._spelling = _piece_spelling(backend)
        for name, token in vars(special_tokens).items():
            if token is not None and backend.token_to_id(token) is None:
                raise ValueError(f"{name} token {token!r} is not in the vocabulary")

    # --- construction --------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, source: Any) -> Tokenizer:
        """Build from a `gguf.GGUFReader` or a mapping of its metadata (key -> value)."""
        metadata = read_gguf_metadata(source) if hasattr(source, "fields") else source
        vocabulary = gguf_vocabulary(metadata)
        return cls(vocabulary.backend, chat_template=vocabulary.chat_template,
                   special_tokens=SpecialTokens(**vocabulary.special_tokens))

    @classmethod
    def from_files(cls, directory: str | Path) -> Tokenizer:
        """Build from a Hugging Face directory: tokenizer.json (+ tokenizer_config.json, chat template)."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: pdserve needs the fast-tokenizer file tokenizer.json next to config.json "
                "(save the tokenizer with transformers' save_pretrained to produce it)")
        backend = BackendTokenizer.from_file(str(path))
        config = read_json_file(directory / "tokenizer_config.json")
        token_map = read_json_file(directory / "special_tokens_map.json")
        names = {name: _token_text(config.get(f"{name}_token", token_map.get(f"{name}_token")))
                 for name in ("bos", "eos", "unk", "pad")}
        return cls(backend, chat_template=_hf_chat_template(directory, config),
                   special_tokens=SpecialTokens(**names))

    # --- encoding ------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text. Special tokens written in text (e.g. <|im_start|>) stay whole."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_after(self, prompt_ids: Sequence[int], ids: Sequence[int]) -> str:
        """The text ids add after prompt_ids: decode(prompt + ids) less decode(prompt), decoded with
        a few prompt tokens of context, as vLLM's incremental detokenizer does. It matters where a
        piece's text depends on what precedes it: a SentencePiece decoder that drops the leading
        space ("▁Paris" alone is "Paris") gives " Paris" after a prompt."""
        context = self._decode_context(prompt_ids)
        before = self.decode(context)
        whole = self.decode([*context, *ids])
        if context and whole.startswith(before):
            return whole[len(before):]
        return self.decode(ids)

    def _decode_context(self, prompt_ids: Sequence[int]) -> Sequence[int]:
        """The shortest tail of the prompt, of 4 to 24 tokens (vLLM's bounds; fewer for a short prompt),
        that decodes to some text with no broken character; none where no tail does."""
        for length in range(min(4, len(prompt_ids)), min(24, len(prompt_ids)) + 1):
            tail = prompt_ids[len(prompt_ids) - length:]
            text = self.decode(tail)
            if text and "\ufffd" not in text:
                return tail
        return ()

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> str:
        """The prompt text the chat template makes of messages (as transformers renders it);
        template_kwargs are extra template variables, e.g. enable_thinking=False (vLLM's
        chat_template_kwargs), over the special tokens' as in transformers."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer.chat_template in GGUF, "
                             "chat_template in tokenizer_config.json); encode a plain prompt instead")
        # Like transformers: keys whose value is None are dropped, as templates test for presence.
        chat = [{key: value for key, value in dict(message).items() if value is not None}
                for message in messages]
        return self._template.render(messages=chat, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **{**self._special_tokens.template_variables(), **template_kwargs})

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """render_chat, then encode with no special tokens added (the template writes them)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **template_kwargs),
                           add_special_tokens=False)

    # --- facts ---------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self._special_tokens.bos)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The eos id, then every special turn terminator the chat template writes."""
        template = self._chat_template or ""
        terminators = [self.token_to_id(token) for token in _TURN_TERMINATORS if token in template]
        ids = [self.token_to_id(self._special_tokens.eos)] + [i for i in terminators if self.is_special(i)]
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    @property
    def special_tokens(self) -> SpecialTokens:
        return self._special_tokens

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, whole even when it is part of a UTF-8 character (what
        OpenAI's logprobs call `bytes`). Pieces are read back by their spelling: byte-level BPE
        byte by byte, SentencePiece with "▁" as a space and <0xNN> as that one byte; special tokens
        and other vocabularies are what the token decodes to alone."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if not self.is_special(token_id):
            raw = _piece_bytes(piece, self._spelling)
            if raw is not None:
                return raw
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def to_json(self) -> str:
        """The tokenizer.json form of this tokenizer."""
        return self._backend.to_str()

    def save(self, directory: str | Path, *, chat_template: str | None = None) -> None:
        """Write tokenizer.json and tokenizer_config.json (chat_template overrides this one's)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / "tokenizer.json"))
        config: dict[str, Any] = {
            # Loads tokenizer.json as written; a model-specific class could rebuild its pre-tokenizer.
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 30,
            **self._special_tokens.template_variables(),
        }
        template = chat_template if chat_template is not None else self._chat_template
        if template is not None:
            config["chat_template"] = template
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        (directory / "tokenizer_config.json").write_text(text, encoding="utf-8")

    def fingerprint(self) -> bytes:
        """sha256 over what decides ids and prompts: vocab, merges, added tokens, pipeline, template."""
        return self._fingerprint

    @cached_property
    def _fingerprint(self) -> bytes:
        spec = json.loads(self._backend.to_str())
        model = spec.get("model") or {}
        vocab = model.get("vocab") or {}
        canonical = {
            "format": "pdserve-tokenizer-v1",
            "model_type": model.get("type"),
            "vocab": sorted(vocab.items(), key=lambda item: item[1]) if isinstance(vocab, dict) else vocab,
            "merges": [" ".join(m) if isinstance(m, list) else m for m in model.get("merges") or []],
            "added_tokens": sorted((t["id"], t["content"], t["special"])
                                   for t in spec.get("added_tokens") or []),
            "pipeline": {key: spec.get(key) for key in ("normalizer", "pre_tokenizer", "decoder")},
            "post_processor": _effective_post_processor(spec.get("post_processor")),
            "special_tokens": vars(self._special_tokens),
            "chat_template": self._chat_template,
        }
        blob = json.dumps(canonical, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).digest()

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self._special_tokens.bos!r}, "
                f"eos_token_ids={self.eos_token_ids}, chat_template={self._template is not None})")


def _effective_post_processor(spec: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """None for a template that adds nothing to a single sequence (transformers saves one)."""
    if spec and spec.get("type") == "TemplateProcessing" and not spec.get("special_tokens"):
        if spec.get("single") == [{"Sequence": {"id": "A", "type_id": 0}}]:
            return None
    return spec


# --- piece spelling --------------------------------------------------------------------
_BYTE_OF_CHAR = byte_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback piece, as ByteFallback reads it


def _piece_spelling(backend: BackendTokenizer) -> PieceSpelling:
    """Read from the decoder: ByteFallback means SentencePiece pieces, ByteLevel GPT-2's alphabet."""
    spec = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    kinds = {spec.get("type")} | {part.get("type") for part in spec.get("decoders") or []}
    if "ByteFallback" in kinds:
        return PieceSpelling.SENTENCEPIECE
    if "ByteLevel" in kinds:
        return PieceSpelling.BYTE_LEVEL
    return PieceSpelling.OTHER


def _piece_bytes(piece: str, spelling: PieceSpelling) -> bytes | None:
    """The bytes a (non-special) piece spells; None where only decoding can tell."""
    if spelling is PieceSpelling.BYTE_LEVEL and all(c in _BYTE_OF_CHAR for c in piece):
        return bytes(_BYTE_OF_CHAR[c] for c in piece)
    if spelling is PieceSpelling.SENTENCEPIECE:
        byte = _BYTE_PIECE.fullmatch(piece)
        return bytes([int(byte.group(1), 16)]) if byte else piece.replace(SPACE_PIECE, " ").encode("utf-8")
    return None


# --- Hugging Face files ------------------------------------------------------------------
def read_json_file(path: Path) -> dict[str, Any]:
    """A Hugging Face JSON file as a dict; {} when it is absent (every one of them is optional)."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); fix or re-save it") from error


def _token_text(value: Any) -> str | None:
    """tokenizer_config writes a special token as text or as a serialised AddedToken."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja (transformers >= 4.50 writes it), else tokenizer_config's chat_template."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    separate = read_json_file(directory / "chat_template.json")
    template = config.get("chat_template", separate.get("chat_template"))
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template}
        if "default" not in named:
            raise ValueError(f"{directory}: chat_template lists {sorted(named)} but no 'default' template")
        template = named["default"]
    return template


# --- chat template -----------------------------------------------------------------------
class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): render the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters; transformers' does not, and templates expect that.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _compile_template(source: str) -> jinja2.Template:
    """The environment transformers renders chat templates in (utils/chat_template_utils.py)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise ValueError(f"chat template does not compile: {error} (line {error.lineno})") from error
