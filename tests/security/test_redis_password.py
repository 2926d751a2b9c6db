"""Redis is not a trust root: the embedded Redis has a generated password, kept by the launcher and
printed only redacted; the deploy manifests require one; a Redis reached in plaintext beyond
loopback is warned about.

Before the fix (seen): the embedded redis-server ran with no password, so any local process could
register a worker in the cluster's registry; deploy/kuberay.yaml and deploy/ray-cluster.yaml ran
Redis on every interface with protected mode off and no password.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml

from deploy.config import ClusterSpec
from deploy.launcher import LocalCluster
from deploy.redis_server import ensure_redis
from pdserve.index.registry import WorkerRegistry
from pdserve.security.redis_auth import redis_exposure_warning, redis_url_with_credentials

ROOT = Path(__file__).resolve().parents[2]

# Another process on this machine: it knows the port (anyone can find it), not the password.
REGISTER = """
import sys, redis
from pdserve.index.registry import WorkerInfo, WorkerRegistry
registry = WorkerRegistry(redis.Redis.from_url(sys.argv[1], socket_timeout=5), "t-auth")
epoch = registry.next_epoch(sys.argv[2])
info = WorkerInfo(sys.argv[2], "decode", "127.0.0.1:1", "node", "fp", 16, "float32", "00" * 16, 64, epoch)
registry.register(info, 60)
print("registered")
"""


def register_from_another_process(url: str, worker_id: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", REGISTER, url, worker_id], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_a_process_without_the_redis_password_cannot_register_a_worker():
    url, server = ensure_redis(None)  # what `pdserve up` starts when no --redis-url is given
    try:
        without_password = redis_url_with_credentials(url, None, None)
        assert without_password != url, "the embedded Redis has no password"
        refused = register_from_another_process(without_password, "intruder")
        assert refused.returncode != 0 and "registered" not in refused.stdout
        assert "Redis refused the credentials" in refused.stderr, refused.stderr[-2000:]

        admitted = register_from_another_process(url, "decode-0")  # a worker, handed the URL by the launcher
        assert admitted.returncode == 0, admitted.stderr[-2000:]
        live = WorkerRegistry(redis.Redis.from_url(url), "t-auth").live_workers()
        assert [w.worker_id for w in live] == ["decode-0"]
        password = redis.connection.parse_url(url)["password"]
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline  # not readable by every local user through ps
    finally:
        server.stop()


class _StopAfterRedis(Exception):
    pass


def test_the_launcher_keeps_the_generated_password_and_prints_it_redacted(monkeypatch):
    def no_ray(self):
        raise _StopAfterRedis

    monkeypatch.setattr(LocalCluster, "_init_ray", no_ray)
    said: list[str] = []
    cluster = LocalCluster(ClusterSpec(), say=said.append)
    try:
        with pytest.raises(_StopAfterRedis):
            cluster._start()
        password = redis.connection.parse_url(cluster.redis_url)["password"]
        assert len(password) >= 32
        assert redis.Redis.from_url(cluster.redis_url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(redis_url_with_credentials(cluster.redis_url, None, None)).ping()
        line = next(s for s in said if s.startswith("redis "))
        assert f"redis://:***@127.0.0.1:{cluster.redis_server.port}/0" in line and "(embedded" in line
        assert all(password not in s for s in said)
        worker_spec = cluster._worker_spec("decode", "decode-0", 1)
        assert worker_spec.redis_url == cluster.redis_url  # what each worker dials
        assert password not in repr(cluster.spec) and password not in repr(worker_spec)
    finally:
        cluster.stop()


@pytest.mark.parametrize("url, warned", [
    ("redis://:pw@127.0.0.1:6379/0", False),
    ("redis://localhost:6379/0", False),
    ("redis://[::1]:6379/0", False),
    ("unix:///run/redis.sock", False),
    ("rediss://:pw@10.0.0.7:6380/0", False),
    ("redis://:pw@10.0.0.7:6380/0", True),
    ("redis://redis.internal:6379/0", True),
])
def test_plaintext_redis_beyond_loopback_is_warned_about(url, warned):
    warning = redis_exposure_warning(url)
    assert (warning is not None) is warned
    if warning is not None:
        assert "rediss://" in warning and "pw" not in warning


def test_the_deploy_manifests_require_a_redis_password():
    kuberay = yaml.safe_load((ROOT / "deploy" / "kuberay.yaml").read_text())
    head = kuberay["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    command = " ".join(head["lifecycle"]["postStart"]["exec"]["command"])
    password_env = next(e for e in head["env"] if e["name"] == "REDIS_PASSWORD")
    assert password_env["valueFrom"]["secretKeyRef"]["name"]
    assert "requirepass" in command and "protected-mode no" not in command
    assert "--redis-url redis://:${REDIS_PASSWORD}@" in command

    ray_up = yaml.safe_load((ROOT / "deploy" / "ray-cluster.yaml").read_text())
    commands = " ".join(ray_up["head_start_ray_commands"])
    assert "requirepass" in commands and "protected-mode no" not in commands
    assert "--redis-url redis://:${REDIS_PASSWORD}@" in commands

    gpu = (ROOT / "deploy" / "examples" / "gpu.yaml").read_text()
    assert "redis://:PASSWORD@" in gpu and "requirepass" in gpu
