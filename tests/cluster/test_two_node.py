"""Acceptance: two Ray nodes on one machine, prefill pinned to one and decode to the other.

    subprocess 1:  this module as a script: ray.cluster_utils.Cluster, a head raylet offering
                   {"prefill": 1} and a second raylet offering {"decode": 1}; prints their ids,
                   shuts both down when its stdin closes
    subprocess 2:  pdserve up --config deploy/examples/two-node.yaml --address <the head>
    this test:     one greedy request through the router, checked against the in-process engine,
                   and each worker's node (from the Redis registry) against the node that offers
                   its role's resource; then Ctrl-C, stdin closed, and no process left behind

NOTE: the cluster lives in its own process because this pytest process may already hold a
local Ray (the `ray_session` fixture); one process can be a driver of only one Ray cluster.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis

from pdserve.client import PdserveClient
from pdserve.index.registry import WorkerRegistry
from pdserve.security.redis_auth import redis_url_with_credentials
from tests.cluster.test_cluster_basics import chat_ids, reference_tokens
from tests.cluster.test_make_up import port_is_free, read_until
from tests.conftest import make_engine

ROOT = Path(__file__).resolve().parents[2]
TWO_NODE = ROOT / "deploy" / "examples" / "two-node.yaml"
QUESTION = "What is the capital of France?"
READY = "two-node cluster: "


def serve_two_nodes() -> None:
    """The subprocess: start both raylets, say where they are, wait for stdin to close."""
    from ray.cluster_utils import Cluster

    node_args = dict(num_cpus=2, include_dashboard=False, object_store_memory=128 << 20)
    cluster = Cluster(initialize_head=True, head_node_args={**node_args, "resources": {"prefill": 1}})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        decode_node = cluster.add_node(**node_args, resources={"decode": 1})
        cluster.wait_for_nodes()
        nodes = {"address": cluster.address, "prefill": cluster.head_node.node_id,
                 "decode": decode_node.node_id}
        print(READY + json.dumps(nodes), flush=True)
        sys.stdin.read()
    finally:
        cluster.shutdown()


def popen(argv: list[str], **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, *argv], cwd=ROOT, text=True, env=env, start_new_session=True,
                            **kwargs)


def descendants(*procs: subprocess.Popen) -> list[psutil.Process]:
    out = []
    for proc in procs:
        try:
            out += psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_all_gone(processes: list[psutil.Process], timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return [" ".join(p.cmdline())[:120] for p in alive]
        time.sleep(0.5)


def stop(proc: subprocess.Popen, how, timeout_s: float) -> None:
    if proc.poll() is None:
        how()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def embedded_redis_url(up_output: str) -> str:
    """The embedded Redis's URL with its password, which `pdserve up` prints only redacted: read from
    the redis.conf it names, as an operator reaching for redis-cli would."""
    found = re.search(r"^redis +(\S+) \(embedded; generated password in (\S+)\)", up_output, re.MULTILINE)
    redacted, config = found.group(1), found.group(2)
    password = re.search(r'^requirepass "(.*)"$', Path(config).read_text(), re.MULTILINE).group(1)
    return redis_url_with_credentials(redacted, None, password)


@pytest.mark.slow
def test_prefill_and_decode_on_their_own_nodes_serve_an_exact_request(smollm_loaded, tmp_path):
    ids = chat_ids(smollm_loaded, QUESTION)
    expected = reference_tokens(make_engine(smollm_loaded), ids, 16)

    with open(tmp_path / "cluster.log", "w") as cluster_log:
        cluster = popen(["-m", "tests.cluster.test_two_node"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        stderr=cluster_log)
        up = None
        try:
            nodes = json.loads(read_until(cluster, READY, timeout_s=120).rsplit(READY, 1)[1])
            up = popen(["-m", "deploy.cli", "up", "--config", str(TWO_NODE), "--address", nodes["address"],
                        "--port", "0", "--metrics-port", "0", "--no-sample"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            output = read_until(up, "serving on", timeout_s=240)
            router = re.search(r"serving on (\S+);", output).group(1)
            redis_url = embedded_redis_url(output)

            assert len(ids) >= 32, "the prompt must be long enough for a remote prefill"
            with PdserveClient(router, timeout_s=120) as client:
                done = client.generate(QUESTION, temperature=0, max_tokens=16, routing="least_load")
            assert "Paris" in done.text
            assert done.token_ids == expected
            assert (done.prefill_worker, done.decode_worker) == ("prefill-0", "decode-0")

            registry = WorkerRegistry(redis.Redis.from_url(redis_url), "pdserve")
            node_of = {info.worker_id: info.node for info in registry.live_workers()}
            assert set(node_of) == {"prefill-0", "decode-0"}
            assert node_of["prefill-0"].endswith("/" + nodes["prefill"][:8]), (node_of, nodes)
            assert node_of["decode-0"].endswith("/" + nodes["decode"][:8]), (node_of, nodes)

            processes = descendants(up, cluster)
            router_port = int(router.rsplit(":", 1)[1])
        finally:
            if up is not None:
                stop(up, lambda: up.send_signal(signal.SIGINT), timeout_s=60)
            stop(cluster, cluster.stdin.close, timeout_s=60)
    assert up.returncode == 0 and cluster.returncode == 0, (tmp_path / "cluster.log").read_text()[-2000:]
    assert not wait_all_gone(processes, timeout_s=20)
    assert port_is_free(router_port)


if __name__ == "__main__":
    serve_two_nodes()
