"""Every path the docs name exists: markdown links to files of the repository, and paths in
backticks (`router/placement.py`, `tests/x.py::test_name`, whose test must be defined there).

A doc that points at a file or a test that is gone promises what nobody can check. Paths a user
makes (certs/, bench/out/, loadtest/out/) and placeholders (<...>, ...) are not the repository's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# (not the READMEs tools write into hidden folders, such as .pytest_cache/README.md)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted(p for p in ROOT.glob("*/README.md") if not p.parent.name.startswith("."))]
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
MADE_BY_USERS = ("certs/", "bench/out", "loadtest/out", "loadtest/results", "/tmp", "~")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)(?:#[^)]*)?\)")
CODE = re.compile(r"`([^`\s]+)`")
PATHLIKE = re.compile(r"^[\w.\-/]+(::[\w\[\]\-.]+)?$")


def links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if "://" not in t and not t.startswith("mailto:")]


def code_paths(text: str) -> list[str]:
    """Backticked tokens that name a file or folder of the repository."""
    found = []
    for token in CODE.findall(text):
        path = token.split("::")[0].rstrip("/,.:;")
        if not PATHLIKE.match(token) or path.startswith(MADE_BY_USERS) or "..." in path:
            continue
        if path.split("/")[0] in TOP and ("/" in path or path in TOP):
            found.append(token.rstrip(",.:;"))
    return found


def missing(doc: Path) -> list[str]:
    text = doc.read_text()
    gone = [t for t in links(text) if not (doc.parent / t).resolve().exists()]
    for token in code_paths(text):
        path, _, test = token.partition("::")
        target = ROOT / path.rstrip("/")
        if not target.exists():
            gone.append(token)
        elif test and not re.search(rf"^\s*(async )?(def|class) {re.escape(test.split('[')[0])}\b",
                                    target.read_text(), re.M):
            gone.append(token)
    return gone


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_path_a_doc_names_exists(doc):
    assert missing(doc) == []


def test_the_check_sees_a_path_that_is_gone(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text("See `router/placement.py`, `router/nowhere.py`,\n"
                   "`tests/test_doc_paths.py::test_nothing`, [a link](gone.md) and `make up`.\n")
    assert code_paths(doc.read_text()) == ["router/placement.py", "router/nowhere.py",
                                          "tests/test_doc_paths.py::test_nothing"]
    assert missing(doc) == ["gone.md", "router/nowhere.py", "tests/test_doc_paths.py::test_nothing"]
