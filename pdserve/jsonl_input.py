"""The `--input FILE` format of `pdserve generate` and `pdserve remote`: one JSON object a line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any


def lines_of(path: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of each line of --input that is not blank."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, line


def object_of_line(line: str, lineno: int) -> dict[str, Any]:
    """The JSON object on one line of --input; ValueError naming the line otherwise."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--input line {lineno}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"--input line {lineno}: expected an object with prompt, messages or token_ids")
    return obj
