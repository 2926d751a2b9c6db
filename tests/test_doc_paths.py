"""Every path the docs name exists: markdown links to files of the repository, and paths in
backticks (`router/placement.py`, `tests/x.py::test_name`, whose test must be defined there, and a
bare `cli.py` read in the folder its line names before it), in the README, docs/, each folder's
README and each study's (studies/*/README.md).

A doc that points at a file or a test that is gone promises what nobody can check. Paths a user
makes (certs/, bench/out/, loadtest/out/) and placeholders (<...>, ...) are not the repository's.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# (not the READMEs tools write into hidden folders, such as .pytest_cache/README.md)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted(p for p in ROOT.glob("*/README.md") if not p.parent.name.startswith(".")),
        *sorted((ROOT / "studies").glob("*/README.md"))]
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
MADE_BY_USERS = ("certs/", "bench/out", "loadtest/out", "loadtest/results", "/tmp", "~")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)(?:#[^)]*)?\)")
CODE = re.compile(r"`([^`\s]+)`")
PATHLIKE = re.compile(r"^[\w.\-/]+(::[\w\[\]\-.]+)?$")
# A bare name of a source or doc file (`cli.py`); output files a user makes (report.json) are not.
SOURCE_FILE_NAME = re.compile(r"^[\w\-]+\.(py|cpp|h|proto|md|toml|yaml|yml)$")


def links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if "://" not in t and not t.startswith("mailto:")]


def code_paths(text: str) -> list[str]:
    """Backticked tokens that name a file or folder of the repository.

    A bare file name (`cli.py`) is read in the folder of the last path with a slash named before it
    on its line, as in a table row "`pdserve/` | the CLI (`cli.py`)"; with no such path before it,
    it must name a file somewhere in the tree.
    """
    found = []
    for line in text.splitlines():
        folder = ""
        for token in CODE.findall(line):
            path = token.split("::")[0].rstrip("/,.:;")
            if not PATHLIKE.match(token) or path.startswith(MADE_BY_USERS) or "..." in path:
                continue
            if path.split("/")[0] in TOP and ("/" in path or path in TOP):
                found.append(token.rstrip(",.:;"))
                if "/" in token:  # a bare `pdserve` is as often the command as the folder
                    folder = folder_of(path)
            elif SOURCE_FILE_NAME.match(path):
                found.append(folder + token.rstrip(",.:;"))
    return found


def folder_of(path: str) -> str:
    """The folder a path names, or the folder of the file it names, with a trailing slash."""
    if (ROOT / path).is_dir() or "." not in path.rsplit("/", 1)[-1]:
        return path.rstrip("/") + "/"
    return path.rsplit("/", 1)[0] + "/" if "/" in path else ""


@functools.cache
def file_names_in_tree() -> frozenset[str]:
    names = set()
    for _folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith((".", "__")) and
                         not d.endswith(".egg-info")]
        names.update(files)
    return frozenset(names)


def missing(doc: Path) -> list[str]:
    text = doc.read_text()
    gone = [t for t in links(text) if not (doc.parent / t).resolve().exists()]
    for token in code_paths(text):
        path, _, test = token.partition("::")
        target = ROOT / path.rstrip("/")
        if "/" not in path and path not in TOP:
            if path not in file_names_in_tree():
                gone.append(token)
        elif not target.exists():
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
                   "`tests/test_doc_paths.py::test_nothing`, [a link](gone.md) and `make up`.\n"
                   "| `pdserve/` | the CLI (`cli.py`), the client (`client.py`) |\n"
                   "`nowhere_at_all.py` and `scoring.py`; a user's `report.json`.\n")
    assert code_paths(doc.read_text()) == ["router/placement.py", "router/nowhere.py",
                                          "tests/test_doc_paths.py::test_nothing", "pdserve/",
                                          "pdserve/cli.py", "pdserve/client.py",
                                          "nowhere_at_all.py", "scoring.py"]
    assert missing(doc) == ["gone.md", "router/nowhere.py", "tests/test_doc_paths.py::test_nothing",
                            "pdserve/cli.py", "nowhere_at_all.py"]
