"""`pdserve audit` and Admin.AuditCluster: a router and two workers in this process over real gRPC
(tiny model), plus a registered worker that is not there. A clean cache exits 0, a corrupt block
exits 1 and shows in its worker's row, an unreachable worker or router exits 3; none crashes."""

from __future__ import annotations

import json
import socket

import grpc
import pytest

from deploy.cli import main
from pdserve.engine.hashing import hash_blocks
from pdserve.worker.server import WorkerConfig
from protos.pdserve.v1 import admin_pb2, admin_pb2_grpc
from tests.engine.test_audit import corrupt
from tests.helpers.cluster import generate, generate_request, running_cluster
from tests.helpers.workers import wait_until_clean, worker_record

PROMPT = list(range(800, 870))  # 70 tokens: prefilled remotely, 4 whole blocks on both workers


def unused_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def cluster(tiny_loaded):
    workers = [WorkerConfig(role, worker_id=f"{role}-0") for role in ("prefill", "decode")]
    with running_cluster(tiny_loaded, workers=workers, num_blocks=64) as c:
        replies = generate(c.router, generate_request(PROMPT))
        assert replies[-1].prefill_worker == "prefill-0"
        yield c.router, c.workers, c.records


def audit(router, capsys, *flags: str) -> tuple[int, str]:
    code = main(["audit", "--router", router.address, "--timeout", "60", *flags])
    return code, capsys.readouterr().out


def row(out: str, worker_id: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.startswith(worker_id + " "))


def test_a_clean_cluster_audits_every_worker_and_exits_0(cluster, capsys):
    router, workers, _ = cluster
    code, out = audit(router, capsys)
    assert code == 0, out
    for worker_id in ("prefill-0", "decode-0"):
        worker, role, state, cached, checked, exact, mismatched, evicted, skipped = row(out, worker_id)[:9]
        assert (state, mismatched, evicted, skipped) == ("audited", "0", "0", "0")
        assert int(checked) == int(cached) >= 4
    assert "rule: bit-exact, else" in out and out.rstrip().endswith("no mismatch")
    wait_until_clean(*workers, timeout_s=0)


def test_a_corrupt_block_exits_1_and_shows_in_its_row_then_is_gone(cluster, capsys):
    router, workers, _ = cluster
    decode = workers[1]
    [block] = decode.engine.pool.match_prefix(hash_blocks(PROMPT, 16, decode.engine.salt))[3:]
    with decode.engine.lock:
        corrupt(decode.engine, block, layer=1)
    code, out = audit(router, capsys)
    assert code == 1, out
    assert row(out, "decode-0")[6:8] == ["1", "1"] and row(out, "prefill-0")[6] == "0"
    assert out.rstrip().endswith("1 mismatched block")
    code, out = audit(router, capsys, "--json")
    reply = json.loads(out)
    assert code == 0 and {w["workerId"] for w in reply["workers"]} == {"prefill-0", "decode-0"}
    wait_until_clean(*workers, timeout_s=0)


def test_an_unreachable_worker_is_a_row_and_exit_3(cluster, capsys):
    router, _, live = cluster
    ghost = worker_record("decode-9", "decode", unused_address())
    live.append(ghost)
    router.directory.refresh()
    try:
        code, out = audit(router, capsys, "--sample", "2")
    finally:
        live.remove(ghost)
        router.directory.refresh()
    assert code == 3, out
    assert row(out, "decode-9")[2:4] == ["unreachable", "-"]
    assert row(out, "decode-0")[2] == "audited" and int(row(out, "decode-0")[4]) >= 1
    assert "decode-9: UNAVAILABLE" in out


def test_an_audit_call_without_a_deadline_gives_the_workers_a_default_one(cluster):
    router, workers, _ = cluster
    with grpc.insecure_channel(router.address) as channel:
        reply = admin_pb2_grpc.AdminStub(channel).AuditCluster(admin_pb2.AuditClusterRequest(sample=1))
    assert [(w.worker_id, w.state, w.audit.complete) for w in reply.workers] == [
        ("prefill-0", "audited", True), ("decode-0", "audited", True)]


def test_an_unreachable_router_exits_3_with_the_reason(capsys):
    code = main(["audit", "--router", unused_address(), "--timeout", "2"])
    err = capsys.readouterr().err
    assert code == 3 and "cannot audit the cluster through" in err


def test_bad_flags_are_usage_errors(capsys):
    assert main(["audit", "--sample", "-1"]) == 2
    assert "--sample must be >= 0" in capsys.readouterr().err
    assert main(["audit", "--timeout", "0"]) == 2
