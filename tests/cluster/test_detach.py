"""`pdserve up --detach --routers 2` as a user runs it (deploy/detached.py), SmolLM2 on a Ray head of its own.

The launcher is SIGKILLed once it has printed the routers (the cluster answered through both); then 4
requests through `pdserve generate --router a,b` all succeed, and `pdserve down --router a` leaves none
of the cluster's processes and none of its ports listening. What the cluster is, is found here without
the production code's own lookup: the processes listening on the ports the launcher printed, everything
in the Ray head's session, and their descendants (the Ray workers, the redis-server of the Redis actor).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid

import psutil

from deploy.redis_server import free_port
from tests.cluster.test_make_up import port_is_free, read_until
from tests.helpers.waiting import eventually, wait_for

CLI = [sys.executable, "-m", "deploy.cli"]
RAY_LINE = re.compile(r"^ray +(\S+) \(its own head", re.MULTILINE)
REDIS_LINE = re.compile(r"^redis +redis://:\*\*\*@127\.0\.0\.1:(\d+)/", re.MULTILINE)
WORKER_LINE = re.compile(r"^ +(?:prefill|decode)-\d+ +\S+:(\d+)$", re.MULTILINE)


def two_free_ports() -> int:
    """A port p such that p and p + 1 are free: router-0's and router-1's."""
    return eventually(lambda: next((p for p in [free_port()] if port_is_free(p + 1)), None), timeout_s=10,
                      what="two adjacent free ports")


def listening(ports: set[int]) -> dict[int, int]:
    """port -> pid of each of ports that a process listens on."""
    return {c.laddr.port: c.pid for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports and c.pid}


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def session_of(proc: psutil.Process) -> int | None:
    try:
        return os.getsid(proc.pid)
    except OSError:
        return None


def cluster_processes(printed_ports: set[int], gcs_port: int) -> list[psutil.Process]:
    """The listeners on the printed ports, every process in the Ray head's session, and their descendants."""
    owners = listening(printed_ports | {gcs_port})
    assert set(owners) == printed_ports | {gcs_port}, f"not listening: {printed_ports - set(owners)}"
    head_session = os.getsid(owners[gcs_port])
    found = {pid: psutil.Process(pid) for pid in owners.values()}
    found.update((p.pid, p) for p in psutil.process_iter() if session_of(p) == head_session)
    for proc in list(found.values()):
        found.update((child.pid, child) for child in proc.children(recursive=True))
    return [proc for proc in found.values() if alive(proc)]


def ports_of(procs: list[psutil.Process]) -> set[int]:
    """Every TCP port one of procs listens on."""
    pids = {proc.pid for proc in procs}
    return {c.laddr.port for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.pid in pids}


def generate(routers: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "generate", "--router", routers, "--temperature", "0", "--max-tokens", "8",
                           "Say hello."], capture_output=True, text=True, timeout=180)


def test_detached_cluster_outlives_a_sigkilled_launcher_and_down_leaves_nothing():
    port, namespace = two_free_ports(), f"t{uuid.uuid4().hex[:6]}"
    a, b = f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"
    launcher = subprocess.Popen(
        [*CLI, "up", "--detach", "--routers", "2", "--port", str(port), "--http-port", "0", "--no-sample",
         "--namespace", namespace],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    gcs, procs, stopped = None, [], False
    try:
        # NOTE: router-1's line comes once every router showed every worker serving; the launcher is
        # killed there, still connected to Ray as its driver, before it prints how to stop the cluster.
        output = read_until(launcher, "router-1", timeout_s=600)
        os.kill(launcher.pid, signal.SIGKILL)
        assert launcher.wait(timeout=30) == -signal.SIGKILL, output
        gcs = RAY_LINE.search(output).group(1)
        printed = {port, port + 1, int(REDIS_LINE.search(output).group(1)),
                   *(int(p) for p in WORKER_LINE.findall(output))}
        assert len(printed) == 5, output  # 2 routers, Redis, 1 prefill + 1 decode worker
        procs = cluster_processes(printed, int(gcs.rsplit(":", 1)[1]))
        ports = ports_of(procs)
        assert any("redis-server" in " ".join(p.cmdline()) for p in procs if alive(p))

        for i in range(4):  # both orders, so that each router serves two of them
            served = generate(f"{a},{b}" if i % 2 == 0 else f"{b},{a}")
            assert served.returncode == 0 and served.stdout.strip(), (i, served.stderr[-2000:])

        down = subprocess.run([*CLI, "down", "--router", a], capture_output=True, text=True, timeout=180)
        assert down.returncode == 0, down.stdout + down.stderr
        stopped = True
        assert wait_for(lambda: not any(alive(p) for p in procs), timeout_s=60), \
            [" ".join(p.cmdline())[:120] for p in procs if alive(p)]
        assert wait_for(lambda: not listening(ports), timeout_s=10), listening(ports)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        if not stopped and gcs is not None:
            subprocess.run([*CLI, "down", "--namespace", namespace, "--address", gcs], timeout=180)
        for proc in procs:  # what a failed test left: ours, by pid
            if alive(proc):
                proc.kill()
