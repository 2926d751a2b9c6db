"""TLS for gRPC servers and channels: one frozen config, checked when it is built.

A TLSConfig describes one process's side of TLS:

    cert, key            the certificate this process serves (a server needs both)
    ca                   the CA it trusts: the root for the servers it dials, and the
                         issuer of client certificates when it serves with mutual TLS
    require_client_cert  serve mutual TLS: a client without a certificate signed by `ca`
                         is refused during the handshake, before any RPC

A client that only dials (the CLI, PdserveClient) needs just `ca` (None = the system's
roots); under mutual TLS it also presents a client certificate, passed to
channel_credentials() or open_channel().

NOTE: file contents are read when credentials are made, not when the config is built, so
a config stays a small, comparable value; the paths are checked at construction so a
typo fails at start-up with the flag named, not at the first handshake.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

ChannelOptions = Sequence[tuple[str, Any]]


def _check_readable(path: str, flag: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{flag} {path}: not readable by this user")


def check_key_pair(cert: str | None, key: str | None, cert_flag: str, key_flag: str) -> None:
    if cert is not None and key is None:
        raise ValueError(f"{cert_flag} given without {key_flag}: a certificate needs its private key")
    if key is not None and cert is None:
        raise ValueError(f"{key_flag} given without {cert_flag}: a private key needs its certificate")
    if cert is not None and key is not None:
        _check_readable(cert, cert_flag)
        _check_readable(key, key_flag)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@dataclass(frozen=True)
class TLSConfig:
    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    require_client_cert: bool = False

    def __post_init__(self) -> None:
        check_key_pair(self.cert, self.key, "--tls-cert", "--tls-key")
        if self.ca is not None:
            _check_readable(self.ca, "--tls-ca")
        if self.require_client_cert and self.ca is None:
            raise ValueError("--tls-require-client-cert needs --tls-ca: the CA that signs the client "
                             "certificates to accept")
        if self.require_client_cert and self.cert is None:
            raise ValueError("--tls-require-client-cert needs --tls-cert and --tls-key: mutual TLS is "
                             "served with a server certificate")

    @property
    def can_serve(self) -> bool:
        return self.cert is not None and self.key is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials; mutual TLS (client certificates signed by `ca`) when required."""
        if self.cert is None or self.key is None:
            raise ValueError("serving TLS needs --tls-cert and --tls-key (this config has only "
                             f"ca={self.ca!r})")
        pair = [(_read(self.key), _read(self.cert))]
        if self.require_client_cert:
            assert self.ca is not None  # checked in __post_init__
            return grpc.ssl_server_credentials(pair, root_certificates=_read(self.ca),
                                               require_client_auth=True)
        return grpc.ssl_server_credentials(pair)

    def channel_credentials(self, client_cert: str | None = None,
                            client_key: str | None = None) -> grpc.ChannelCredentials:
        """Channel credentials trusting `ca` (None: the system roots), with an optional client cert."""
        check_key_pair(client_cert, client_key, "--tls-client-cert", "--tls-client-key")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca) if self.ca is not None else None,
            private_key=_read(client_key) if client_key is not None else None,
            certificate_chain=_read(client_cert) if client_cert is not None else None)


def add_port(server: grpc.Server, address: str, tls: TLSConfig | None) -> int:
    """Bind address with TLS when tls is given, plaintext otherwise; returns the port (0: failed)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def open_channel(target: str, tls: TLSConfig | None, options: ChannelOptions = (), aio: bool = False, *,
                 client_cert: str | None = None, client_key: str | None = None,
                 interceptors: Sequence[Any] = ()) -> Any:
    """A grpc.Channel (or grpc.aio.Channel when aio): TLS when tls is given, plaintext otherwise.

    interceptors are client interceptors of the matching flavour (see auth.metadata_interceptors).
    """
    options = list(options)
    credentials = tls.channel_credentials(client_cert, client_key) if tls is not None else None
    if aio:
        if credentials is None:
            return grpc.aio.insecure_channel(target, options, interceptors=list(interceptors) or None)
        return grpc.aio.secure_channel(target, credentials, options, interceptors=list(interceptors) or None)
    channel = (grpc.secure_channel(target, credentials, options) if credentials is not None
               else grpc.insecure_channel(target, options))
    return grpc.intercept_channel(channel, *interceptors) if interceptors else channel
