"""The committed gRPC stubs match their .proto sources; if this fails, run `make protos`.

Stubs are committed so that running pdserve needs no grpc_tools. The comparison ignores the
lines that only record the generator's version, so a different grpcio-tools release fails
only when it changes the generated code itself.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools.protoc")

ROOT = Path(__file__).resolve().parents[1]
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
VERSION_STAMPS = re.compile(
    r"^# Protobuf Python Version: .*$"
    r"|^GRPC_GENERATED_VERSION = .*$"
    r"|_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)",
    re.M,
)


def proto_sources() -> list[Path]:
    return sorted(p.relative_to(ROOT) for p in (ROOT / "protos").rglob("*.proto"))


def stubs_of(proto: Path) -> list[Path]:
    return [proto.with_name(proto.stem + suffix) for suffix in STUB_SUFFIXES]


def without_version_stamps(text: str) -> str:
    return VERSION_STAMPS.sub("<version>", text)


def committed_text(stub: Path) -> str | None:
    path = ROOT / stub
    return without_version_stamps(path.read_text()) if path.exists() else None


def test_there_are_protos():
    assert Path("protos/pdserve/v1/kv_transfer.proto") in proto_sources()


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    sources = proto_sources()
    out = f"{tmp_path}"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={out}",
                    f"--grpc_python_out={out}", f"--pyi_out={out}", *map(str, sources)],
                   cwd=ROOT, check=True, capture_output=True, text=True)
    stale = [str(stub) for proto in sources for stub in stubs_of(proto)
             if committed_text(stub) != without_version_stamps((tmp_path / stub).read_text())]
    assert not stale, f"stale or missing generated stubs {stale}: run `make protos` and commit them"


def test_no_stub_outlives_its_proto():
    expected = {s for proto in proto_sources() for s in stubs_of(proto)}
    found = {p.relative_to(ROOT) for suffix in STUB_SUFFIXES for p in (ROOT / "protos").rglob(f"*{suffix}")}
    assert not found - expected, f"stubs without a .proto: {sorted(map(str, found - expected))}; delete them"
