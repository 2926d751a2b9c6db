"""`pdserve up` as a user runs it: sample answer, served from another shell, Ctrl-C cleans up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from deploy.redis_server import free_port


def read_until(proc: subprocess.Popen, marker: str, timeout_s: float) -> str:
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if marker in line:
            return "".join(seen)
    raise AssertionError(f"{marker!r} not seen within {timeout_s} s; output:\n{''.join(seen)}")


def port_is_free(port: int) -> bool:
    return not any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                   for c in psutil.net_connections(kind="tcp"))


@pytest.mark.slow
def test_up_answers_serves_and_ctrl_c_leaves_nothing(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output = read_until(proc, "serving on", timeout_s=300)
        assert "Paris" in output
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert any("redis-server" in " ".join(p.cmdline()) for p in descendants)
        command = [sys.executable, "-m", "pdserve.cli", "generate", "--router", f"127.0.0.1:{port}",
                   "--temperature", "0", "--max-tokens", "8", "Say hello."]
        served = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert served.returncode == 0 and served.stdout.strip(), served.stderr
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(1.0)
    alive = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [" ".join(p.cmdline())[:120] for p in alive]
    assert port_is_free(port)
