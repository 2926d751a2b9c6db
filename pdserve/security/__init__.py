"""Transport security and authentication for pdserve's gRPC services and Redis.

The model:

    caller                  service                          credential          TLS
    ------                  -------                          ----------          ---
    users, CLI, client      router Generation, Admin         bearer API token    optional, mTLS optional
    router                  worker Worker                    cluster secret      optional, mTLS optional
    prefill worker          decode worker KVTransfer         cluster secret      optional, mTLS optional
    anyone                  grpc.health.v1, reflection       none (exempt)       as the port
    router, workers         Redis (registry, prefix index)   URL user/password   rediss:// optional

Public and internal credentials are distinct, so an API token never opens an internal
service. Credentials ride in gRPC metadata (auth.py), checked by a server interceptor
before any handler runs; a refusal is UNAUTHENTICATED. TLS (tls.py) encrypts and, with
mutual TLS, also refuses unknown clients during the handshake. certs.py makes a
development CA. Servers bind 127.0.0.1 unless told otherwise;
SecurityConfig.exposure_warnings() says what a wider bind leaves open.

Files:
    tls.py         TLSConfig, add_port, open_channel
    auth.py        BearerTokenInterceptor, ClusterSecretInterceptor, metadata_interceptors, read_secret
    config.py      SecurityConfig: the above composed for one process
    certs.py       make_dev_ca and `python -m pdserve.security.certs` (needs `cryptography`)
    redis_auth.py  credentials in Redis URLs
    files.py       TLSFiles: a cluster's TLS file paths (pure, no grpc)

NOTE: the names below are imported when first used, not with the package, so importing the pure
files.py (deploy/config.py does, to check a config file) does not import grpc. certs is not among
them, so `python -m pdserve.security.certs` runs cleanly and serving never needs `cryptography`.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "AUTHORIZATION_KEY": "auth",
    "CLUSTER_SECRET_KEY": "auth",
    "EXEMPT_METHODS": "auth",
    "BearerTokenInterceptor": "auth",
    "ClusterSecretInterceptor": "auth",
    "metadata_interceptors": "auth",
    "read_secret": "auth",
    "read_secrets_file": "auth",
    "SecurityConfig": "config",
    "is_loopback": "config",
    "TLSFiles": "files",
    "TLSConfig": "tls",
    "add_port": "tls",
    "open_channel": "tls",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
