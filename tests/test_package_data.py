"""The built package carries every C++ file pdserve's CPU kernels compile on first use: a wheel
without one cannot build them (pyproject.toml's package-data against cpu_kernels' lists)."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

from pdserve.engine import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_source_and_header_is_package_data():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["pdserve.engine"]
    for path in (*cpu_kernels.SOURCES, *cpu_kernels.HEADERS):
        assert path.exists(), path
        assert any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns), (path.name, patterns)
