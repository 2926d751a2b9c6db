"""What the wheel carries, read from pyproject.toml's setuptools configuration: every C++ file pdserve's
CPU kernels compile on first use (a wheel without one cannot build them), the simulator's cost files,
every product package, and not bench/."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import setuptools

from pdserve.engine import cpu_kernels
from sim.cli import DEFAULT_CPU_COSTS, GPU_COSTS

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_source_and_header_is_package_data():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["pdserve.engine"]
    for path in (*cpu_kernels.SOURCES, *cpu_kernels.HEADERS):
        assert path.exists(), path
        assert any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns), (path.name, patterns)


def test_the_wheel_ships_the_product_and_not_the_benchmarks():
    """bench/ runs from the checkout (`python -m bench.X`); what setuptools finds with pyproject.toml's
    include is every product package and nothing under bench/."""
    include = _setuptools()["packages"]["find"]["include"]
    found = set(setuptools.find_packages(where=str(ROOT), include=include))
    assert not {p for p in found if p.split(".")[0] == "bench"}, include
    assert {"pdserve", "pdserve.engine", "router", "prefill_worker", "decode_worker", "deploy", "loadtest",
            "sim", "protos.pdserve.v1"} <= found


def test_the_simulators_default_cost_files_are_package_data():
    """`pdserve sim run` reads sim/data/this_machine.json beside its module (sim/cli.py's DATA)."""
    patterns = _setuptools()["package-data"]["sim"]
    files = sorted((ROOT / "sim" / "data").glob("*.json"))
    assert Path(DEFAULT_CPU_COSTS) in files and Path(GPU_COSTS) in files
    for path in files:
        inside = str(path.relative_to(ROOT / "sim"))
        assert any(fnmatch.fnmatch(inside, pattern) for pattern in patterns), (inside, patterns)


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
