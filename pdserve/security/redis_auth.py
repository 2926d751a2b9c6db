"""Redis credentials travel in the Redis URL; helpers to put them there, hide them, and check them.

    redis://[[username]:password@]host:port/db      (rediss:// for TLS to Redis)

redis-py sends `AUTH username password` (an ACL user, Redis >= 6) or `AUTH password` (the
`default` user, i.e. requirepass) on every new connection. A user for pdserve needs the key
space it uses and the commands of the registry and the prefix index, e.g. in an ACL file:

    user pdserve on >LONG-RANDOM-PASSWORD ~* &* +@all -@dangerous
    user default off

Log URLs through redact_redis_url(): a URL with credentials is itself a secret. Beyond
loopback, use rediss://: the password, the registry and the prefix index otherwise cross
the network in plaintext (redis_exposure_warning() says so at start).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import quote, urlsplit, urlunsplit

import redis


class RedisAuthFailed(RuntimeError):
    """Redis refused the credentials in the URL; the message names the URL with its password hidden."""


def redis_url_with_credentials(url: str, username: str | None, password: str | None) -> str:
    """url with its user and password replaced (both percent-encoded); None leaves that part out.

    A username without a password is refused: Redis has no password-less AUTH.
    """
    if username is not None and password is None:
        raise ValueError(f"Redis user {username!r} given without a password")
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"not a Redis URL (redis://, rediss:// or unix://): {redact_redis_url(url)}")
    host = parts.netloc.rpartition("@")[2]
    userinfo = ""
    if password is not None:
        userinfo = f"{quote(username or '', safe='')}:{quote(password, safe='')}@"
    return urlunsplit(parts._replace(netloc=userinfo + host))


def redact_redis_url(url: str) -> str:
    """url with the password replaced by '***' (the username is kept: it helps debugging ACLs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def redis_exposure_warning(url: str) -> str | None:
    """What is exposed when Redis is reached at url in plaintext beyond this machine; None when the
    URL is loopback, a unix socket, or TLS (rediss://)."""
    parts = urlsplit(url)
    if parts.scheme in ("rediss", "unix") or _is_loopback(parts.hostname or ""):
        return None
    password = "its password, " if parts.password is not None else "no password (anyone on the network " \
        "can write the registry), "
    return (f"Redis at {redact_redis_url(url)} is reached in plaintext beyond loopback: {password}the worker "
            "registry and the prefix index cross the network unencrypted. Use rediss:// (TLS) and a "
            "password (requirepass or an ACL user), or keep Redis on a private network")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_redis_credentials(url: str, timeout_s: float = 2.0) -> None:
    """PING Redis at url; RedisAuthFailed when it refuses the credentials (or demands some)."""
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        client.ping()
    except redis.AuthenticationError as e:
        raise RedisAuthFailed(f"Redis at {redact_redis_url(url)} refused the credentials ({e}); check the "
                              "user and password in --redis-url and the server's ACL") from e
    except redis.ResponseError as e:
        if "NOAUTH" not in str(e) and "NOPERM" not in str(e):
            raise
        raise RedisAuthFailed(f"Redis at {redact_redis_url(url)} needs credentials or more permissions "
                              f"({e}); put them in --redis-url: redis://USER:PASSWORD@host:port/0") from e
    finally:
        client.close()
