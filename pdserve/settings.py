"""Settings declared once: a config dataclass field carries its flag, file key, help and choices.

    @dataclass(frozen=True)
    class CacheConfig:
        block_size: int = setting(16, flag="--block-size", key="cache.block_size",
                                  help="tokens per KV block")

A front end (deploy/config.py's file reader, deploy/cli.py's `pdserve up` parser) walks a root
dataclass and the config dataclasses it composes, and builds itself from what it finds:

    walk(ClusterSpec) -> Leaf(path="engine.cache.block_size", setting=Setting(flag, key, help, ...))

A leaf field either is a `setting(...)` or says, with `not_a_setting(why=...)`, who sets it instead
(the launcher, a test, a constant in code); a field whose type is a dataclass is a part, walked into.
A setting may be file-only or flag-only, with its reason (a mapping has no flag syntax).

compose(root, {path: value}) rebuilds the root with values at dotted paths; a part that refuses a
value raises FieldError under its own field name, which compose re-words with the path's label
(`cache.kv_dtype (--kv-dtype) must be one of ...`), so a message names what the user wrote.

Pure: dataclasses and typing only (no argparse, yaml, network), so the library's config modules can
import it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass
from typing import Any

from pdserve.field_error import FieldError

SETTING = "pdserve.setting"  # the field metadata key of a Setting
NOT_A_SETTING = "pdserve.not_a_setting"  # the field metadata key of the reason a field is not one


@dataclass(frozen=True)
class Setting:
    """How a user sets one field: its `pdserve up` flag and its file key (the dotted path in the YAML)."""

    help: str  # for --help; its first clause, up to ': ', says what the setting is
    flag: str | None = None  # "--block-size"; None: file only (file_only says why)
    key: str | None = None  # "cache.block_size"; None: flag only (flag_only says why)
    choices: tuple[str, ...] = ()  # shown in --help; the dataclass itself checks the value
    metavar: str | None = None
    file_only: str | None = None  # why there is no flag
    flag_only: str | None = None  # why there is no file key
    is_path: bool = False  # names a file: in a config file, relative to that file
    renamed_from: tuple[str, str] | None = None  # (old key, old flag): refused, naming this setting

    def __post_init__(self) -> None:
        if self.flag is None and not self.file_only:
            raise ValueError(f"setting {self.key}: no flag, so file_only must say why")
        if self.key is None and not self.flag_only:
            raise ValueError(f"setting {self.flag}: no file key, so flag_only must say why")

    @property
    def summary(self) -> str:
        return self.help.partition(": ")[0]


def setting(default: Any = MISSING, *, help: str, flag: str | None = None, key: str | None = None,
            choices: tuple[str, ...] = (), metavar: str | None = None, file_only: str | None = None,
            flag_only: str | None = None, is_path: bool = False,
            renamed_from: tuple[str, str] | None = None, default_factory: Any = MISSING,
            repr: bool = True) -> Any:
    """A dataclass field that a user sets (see the module docstring)."""
    meta = Setting(help=help, flag=flag, key=key, choices=tuple(choices), metavar=metavar,
                   file_only=file_only, flag_only=flag_only, is_path=is_path, renamed_from=renamed_from)
    return dataclasses.field(default=default, default_factory=default_factory, repr=repr,
                             metadata={SETTING: meta})


def not_a_setting(default: Any = MISSING, *, why: str, default_factory: Any = MISSING,
                  repr: bool = True) -> Any:
    """A dataclass field no flag or file key sets; `why` says who sets it instead."""
    return dataclasses.field(default=default, default_factory=default_factory, repr=repr,
                             metadata={NOT_A_SETTING: why})


@dataclass(frozen=True)
class Leaf:
    """One field at the end of a walk: its dotted path from the root, its type and its declaration."""

    path: str
    field: dataclasses.Field
    type: Any  # the resolved annotation: int, float | None, dict[str, str], ...
    setting: Setting | None  # None: not a setting (not_a_setting gives why), or undeclared

    @property
    def not_a_setting(self) -> str | None:
        return self.field.metadata.get(NOT_A_SETTING)

    @property
    def default(self) -> Any:
        if self.field.default is not MISSING:
            return self.field.default
        if self.field.default_factory is not MISSING:
            return self.field.default_factory()
        return MISSING

    @property
    def label(self) -> str:
        """How a user names it: 'cache.kv_dtype (--kv-dtype)'; the path when it is not a setting."""
        s = self.setting
        if s is None:
            return self.path
        if s.key and s.flag:
            return f"{s.key} ({s.flag})"
        return s.key or s.flag or self.path

    def accepted_types(self) -> tuple[type, ...]:
        """The Python types a file value may have: int for a float field too, NoneType for an optional."""
        out: list[type] = []
        for t in _members(self.type):
            origin = typing.get_origin(t) or t
            out.extend((int, float) if origin is float else (origin,))
        return tuple(dict.fromkeys(out))

    @property
    def optional(self) -> bool:
        return type(None) in _members(self.type)

    def scalar_type(self) -> type:
        """The type a flag's text is converted to: int, float, str or bool."""
        return next(t for t in _members(self.type) if t is not type(None))


def walk(root: type, prefix: str = "") -> Iterator[Leaf]:
    """Every leaf field of root and of the config dataclasses it composes, depth first, in field order."""
    hints = typing.get_type_hints(root)
    for f in dataclasses.fields(root):
        path, hint = prefix + f.name, hints[f.name]
        if _is_part(f, hint):
            yield from walk(hint, path + ".")
        else:
            yield Leaf(path, f, hint, f.metadata.get(SETTING))


def settings(root: type) -> list[Leaf]:
    """The leaves of root that a user sets."""
    return [leaf for leaf in walk(root) if leaf.setting is not None]


def parts(root: type, prefix: str = "") -> Iterator[tuple[str, type]]:
    """(path, dataclass) of root and every part under it: ('', ClusterSpec), ('engine', EngineConfig), ..."""
    yield prefix.rstrip("."), root
    hints = typing.get_type_hints(root)
    for f in dataclasses.fields(root):
        if _is_part(f, hints[f.name]):
            yield from parts(hints[f.name], prefix + f.name + ".")


def compose(base: Any, values: Mapping[str, Any], label: typing.Callable[[str], str] = str,
            prefix: str = "") -> Any:
    """base with the values at their dotted paths replaced, each part rebuilt (and so checked) once;
    a FieldError of a part is re-raised as a ValueError named by label(its path)."""
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        head, _, rest = path.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            top[head] = value
    for name, sub in nested.items():
        top[name] = compose(getattr(base, name), sub, label, f"{prefix}{name}.")
    try:
        return dataclasses.replace(base, **top)
    except FieldError as exc:
        raise ValueError(exc.named(label(prefix + exc.field))) from None


def _is_part(f: dataclasses.Field, hint: Any) -> bool:
    return dataclasses.is_dataclass(hint) and isinstance(hint, type) and NOT_A_SETTING not in f.metadata \
        and SETTING not in f.metadata


def _members(hint: Any) -> tuple[Any, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)
