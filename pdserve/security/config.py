"""SecurityConfig: one process's TLS and credentials, composed from the parts in this package."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.security.auth import (
    BearerTokenInterceptor,
    ClusterSecretInterceptor,
    auth_metadata,
    check_secret,
    metadata_interceptors,
)
from pdserve.security.files import TLSFiles
from pdserve.security.tls import ChannelOptions, TLSConfig, add_port, check_key_pair, open_channel


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses; False for 0.0.0.0, '' and every other address."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class SecurityConfig:
    """What one process serves with and dials with; the default is plaintext and no credentials.

    tls           serve with TLS (cert/key), and dial trusting tls.ca; None = plaintext both ways
    client_cert   the certificate (and client_key) presented when dialling a mutual-TLS server
    api_tokens    server: the bearer tokens the public API accepts (empty = no check);
                  client: the one token it presents
    cluster_secret  the secret internal services demand and internal clients send (None = no check)

    NOTE: the tokens and the secret are left out of repr(), so a config that ends up in a log
    line or a traceback does not print them.
    """

    tls: TLSConfig | None = None
    client_cert: str | None = None
    client_key: str | None = None
    api_tokens: tuple[str, ...] = field(default=(), repr=False)
    cluster_secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_tokens", tuple(self.api_tokens))
        for n, token in enumerate(self.api_tokens, 1):
            check_secret(token, f"API token #{n}")
        if len(set(self.api_tokens)) != len(self.api_tokens):
            raise ValueError("--api-token-file lists the same token twice")
        if self.cluster_secret is not None:
            check_secret(self.cluster_secret, "cluster secret")
            if self.cluster_secret in self.api_tokens:
                raise ValueError("the cluster secret must differ from every API token: a holder of a "
                                 "public token would otherwise reach the internal services")
        check_key_pair(self.client_cert, self.client_key, "--tls-client-cert", "--tls-client-key")
        if self.client_cert is not None and self.tls is None:
            raise ValueError("--tls-client-cert needs TLS (--tls-ca): a client certificate is only sent "
                             "over a TLS channel")

    @classmethod
    def of_files(cls, files: TLSFiles, api_tokens: tuple[str, ...] = (),
                 cluster_secret: str | None = None) -> SecurityConfig:
        """What a process of a cluster serves and dials with, from the cluster's TLS file paths (read
        here, on this node) and the credentials already read."""
        tls = (TLSConfig(files.cert, files.key, files.ca, files.require_client_cert)
               if files.serves_tls else None)
        return cls(tls=tls, client_cert=files.client_cert, client_key=files.client_key,
                   api_tokens=api_tokens, cluster_secret=cluster_secret)

    def server_interceptors(self, public: bool) -> list[grpc.ServerInterceptor]:
        """Gates for a server: bearer tokens on the public API, the cluster secret on internal ones."""
        if public:
            return [BearerTokenInterceptor(self.api_tokens)] if self.api_tokens else []
        return [ClusterSecretInterceptor(self.cluster_secret)] if self.cluster_secret is not None else []

    def client_interceptors(self, internal: bool, aio: bool = False) -> list[Any]:
        """Interceptors that attach this process's credential to every call it makes."""
        token, secret = self._client_credential(internal)
        return metadata_interceptors(token=token, cluster_secret=secret, aio=aio)

    def client_metadata(self, internal: bool) -> tuple[tuple[str, str], ...]:
        """The same credential as metadata pairs, for APIs that take metadata per call (PdserveClient)."""
        token, secret = self._client_credential(internal)
        return auth_metadata(token=token, cluster_secret=secret)

    def _client_credential(self, internal: bool) -> tuple[str | None, str | None]:
        """(token, cluster secret) a client sends: the secret to internal services, a token to the API."""
        if internal:
            return None, self.cluster_secret
        if len(self.api_tokens) > 1:
            raise ValueError(f"a client presents one API token; this config holds {len(self.api_tokens)}")
        return (self.api_tokens[0] if self.api_tokens else None), None

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials (with the client certificate, if any); None for plaintext."""
        if self.tls is None:
            return None
        return self.tls.channel_credentials(self.client_cert, self.client_key)

    def describe(self) -> str:
        """What is on, for a start-up line: 'TLS (mutual) · 2 API tokens · cluster secret'."""
        tls = "off" if self.tls is None else "mutual" if self.tls.require_client_cert else "on"
        tokens = f"{len(self.api_tokens)} API token{'s' if len(self.api_tokens) != 1 else ''}"
        return (f"TLS {tls} · {tokens if self.api_tokens else 'API tokens off'} · "
                f"cluster secret {'on' if self.cluster_secret is not None else 'off'}")

    def add_port(self, server: grpc.Server, address: str) -> int:
        return add_port(server, address, self.tls)

    def open_channel(self, target: str, options: ChannelOptions = (), *, internal: bool,
                     aio: bool = False) -> Any:
        """A channel with this config's TLS and the credential for an internal or public service."""
        return open_channel(target, self.tls, options, aio, client_cert=self.client_cert,
                            client_key=self.client_key, interceptors=self.client_interceptors(internal, aio))

    def exposure_warnings(self, host: str, public: bool) -> list[str]:
        """What is open to the network when a server binds host with this config ([] on loopback)."""
        if is_loopback(host):
            return []
        what = "the public API" if public else "internal services"
        warnings = []
        if self.tls is None:
            warnings.append(f"{what} on {host} without TLS: traffic, tokens and secrets travel in clear "
                            "text (--tls-cert/--tls-key)")
        if public and not self.api_tokens:
            warnings.append(f"{what} on {host} without --api-token-file: anyone who can reach it can "
                            "generate")
        if not public and self.cluster_secret is None:
            warnings.append(f"{what} on {host} without --cluster-secret-file: anyone who can reach it can "
                            "push KV blocks and run requests")
        return warnings

