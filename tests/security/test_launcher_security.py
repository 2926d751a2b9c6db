"""`pdserve up`'s side of security, without Ray: what the launcher reads from the spec's files, what
it hands the router and each worker actor, and that a Redis password never reaches its output."""

from __future__ import annotations

import pickle
import signal

import pytest

from deploy.config import ClusterSpec
from deploy.launcher import LocalCluster
from deploy.redis_server import RedisServer
from deploy.up import client_flags
from pdserve.engine.sampling_defaults import SamplingDefaults
from pdserve.security import SecurityConfig, TLSConfig, TLSFiles
from pdserve.security.redis_auth import RedisAuthFailed
from router.limits import RequestLimits

TOKENS, SECRET = ("token-one-aaaa", "token-two-bbbb"), "the-cluster-secret-cccc"


@pytest.fixture
def secured_spec(dev_certs, tmp_path) -> ClusterSpec:
    (tmp_path / "tokens.txt").write_text("# accepted\n" + "\n".join(TOKENS) + "\n")
    (tmp_path / "secret.txt").write_text(SECRET + "\n")
    tls = TLSFiles(cert=dev_certs.server_cert, key=dev_certs.server_key, ca=dev_certs.ca,
                   require_client_cert=True, client_cert=dev_certs.client_cert,
                   client_key=dev_certs.client_key)
    return ClusterSpec(tls=tls, api_token_file=str(tmp_path / "tokens.txt"),
                       cluster_secret_file=str(tmp_path / "secret.txt"),
                       limits=RequestLimits(max_prompt_tokens=100, max_tokens_limit=50,
                                            max_message_bytes=1 << 16, max_concurrent_streams=8),
                       metrics_port=None)


def test_the_router_gets_every_token_the_secret_tls_and_the_limits(secured_spec, dev_certs):
    cluster = LocalCluster(secured_spec)
    cluster.security = cluster._read_security()
    cluster.redis_url = "redis://127.0.0.1:1/0"
    config = cluster._router_config(512, SamplingDefaults())
    assert config.security == SecurityConfig(
        tls=TLSConfig(dev_certs.server_cert, dev_certs.server_key, dev_certs.ca, True),
        client_cert=dev_certs.client_cert, client_key=dev_certs.client_key, api_tokens=TOKENS,
        cluster_secret=SECRET)
    limits = config.limits
    assert (limits.max_prompt_tokens, limits.max_tokens_limit, limits.max_message_bytes,
            limits.max_concurrent_streams) == (100, 50, 1 << 16, 8)
    assert cluster.security.describe() == "TLS mutual · 2 API tokens · cluster secret on"


def test_a_worker_spec_carries_plain_values_and_rebuilds_the_workers_config(secured_spec, dev_certs):
    cluster = LocalCluster(secured_spec)
    cluster.security = cluster._read_security()
    cluster.redis_url = "redis://pdserve:redis-password-dddd@10.0.0.1:6379/0"
    spec = cluster._worker_spec("prefill", "prefill-0", threads=None)
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert (spec.tls.cert, spec.tls.ca, spec.tls.client_cert, spec.cluster_secret) == (
        dev_certs.server_cert, dev_certs.ca, dev_certs.client_cert, SECRET)
    worker = spec.security_config()
    assert worker == SecurityConfig(tls=cluster.security.tls, client_cert=dev_certs.client_cert,
                                    client_key=dev_certs.client_key, cluster_secret=SECRET)
    assert worker.api_tokens == ()  # a worker serves no public API
    for shown in (repr(spec), repr(worker), repr(cluster.security)):
        assert SECRET not in shown and "redis-password" not in shown and TOKENS[0] not in shown


def test_a_client_of_the_cluster_presents_the_first_token_and_the_client_certificate(secured_spec, dev_certs):
    cluster = LocalCluster(secured_spec)
    cluster.security = cluster._read_security()
    client = cluster.client_security()
    assert client == SecurityConfig(tls=TLSConfig(ca=dev_certs.ca), client_cert=dev_certs.client_cert,
                                    client_key=dev_certs.client_key, api_tokens=TOKENS[:1])
    assert client_flags(secured_spec, num_tokens=2) == (
        f" --tls-ca {dev_certs.ca} --tls-client-cert {dev_certs.client_cert} --tls-client-key "
        f"{dev_certs.client_key} --api-token-file ONE-TOKEN-FILE")
    assert client_flags(ClusterSpec(), num_tokens=0) == ""


def test_an_open_cluster_reads_nothing():
    cluster = LocalCluster(ClusterSpec())
    assert cluster._read_security() == SecurityConfig()
    assert cluster._read_security().describe() == "TLS off · API tokens off · cluster secret off"


@pytest.mark.parametrize("change, message", [
    ({"tls": TLSFiles(cert="/nonexistent/server.pem", key="/nonexistent/server-key.pem")},
     "--tls-cert /nonexistent/server.pem: no such file"),
    ({"api_token_file": "/nonexistent/tokens.txt"}, "API token file /nonexistent/tokens.txt: no such file"),
])
def test_a_missing_file_fails_before_anything_starts(secured_spec, change, message):
    from dataclasses import replace

    said: list[str] = []
    with pytest.raises(ValueError, match=message):
        LocalCluster(replace(secured_spec, **change), say=said.append).start()
    assert said == []  # not even Redis


@pytest.fixture
def redis_with_password():
    with RedisServer(password="redis-password-eeee") as server:
        yield server


class _Stop(Exception):
    pass


def test_the_redis_password_is_never_printed(redis_with_password, monkeypatch):
    port = redis_with_password.port
    said: list[str] = []

    def no_ray(self):
        raise _Stop

    monkeypatch.setattr(LocalCluster, "_init_ray", no_ray)  # stop right after Redis
    with pytest.raises(_Stop):
        LocalCluster(ClusterSpec(redis_url=redis_with_password.url), say=said.append).start()
    assert said[-1] == f"redis    redis://:***@127.0.0.1:{port}/0"

    wrong = f"redis://:not-the-password-ffff@127.0.0.1:{port}/0"
    with pytest.raises(RedisAuthFailed) as refused:
        LocalCluster(ClusterSpec(redis_url=wrong), say=said.append).start()
    assert f"redis://:***@127.0.0.1:{port}/0" in str(refused.value)
    shown = "\n".join([*said, str(refused.value), repr(ClusterSpec(redis_url=redis_with_password.url))])
    assert "redis-password-eeee" not in shown and "not-the-password-ffff" not in shown


def test_pdserve_up_with_a_refused_redis_password_is_a_usage_error(redis_with_password, capsys):
    from deploy.cli import main

    wrong = f"redis://:not-the-password-ffff@127.0.0.1:{redis_with_password.port}/0"
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert main(["up", "--redis-url", wrong, "--no-sample"]) == 2
    finally:
        for s, handler in handlers.items():  # run_up ignores both while it tears down
            signal.signal(s, handler)
    captured = capsys.readouterr()
    assert "error: Redis at redis://:***@" in captured.err and "refused the credentials" in captured.err
    assert "not-the-password" not in captured.out + captured.err
