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

NOTE: certs is not imported here, so `python -m pdserve.security.certs` runs cleanly and
serving never needs `cryptography`.
"""

from pdserve.security.auth import (
    AUTHORIZATION_KEY,
    CLUSTER_SECRET_KEY,
    EXEMPT_METHODS,
    BearerTokenInterceptor,
    ClusterSecretInterceptor,
    metadata_interceptors,
    read_secret,
    read_secrets_file,
)
from pdserve.security.config import SecurityConfig, is_loopback
from pdserve.security.tls import TLSConfig, add_port, open_channel

__all__ = [
    "AUTHORIZATION_KEY",
    "CLUSTER_SECRET_KEY",
    "EXEMPT_METHODS",
    "BearerTokenInterceptor",
    "ClusterSecretInterceptor",
    "SecurityConfig",
    "TLSConfig",
    "add_port",
    "is_loopback",
    "metadata_interceptors",
    "open_channel",
    "read_secret",
    "read_secrets_file",
]
