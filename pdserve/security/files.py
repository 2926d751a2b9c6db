"""TLSFiles: a cluster's TLS files as paths, the one declaration the launcher and every worker share.

Pure (no grpc): deploy/config.py composes it into ClusterSpec and checks a file in milliseconds;
a worker receives it in its WorkerSpec and reads the files on its own node, through
SecurityConfig.of_files (pdserve/security/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TLSFiles:
    """None everywhere = plaintext. Which settings go together is checked by the front end that
    names them for its user (deploy/config.py); whether the files exist, when they are read."""

    cert: str | None = None  # the certificate the router and every worker serve
    key: str | None = None
    ca: str | None = None  # trusted when the router and workers dial each other (and clients: mTLS)
    require_client_cert: bool = False  # mutual TLS on every server
    client_cert: str | None = None  # what the router and prefill workers present under mutual TLS
    client_key: str | None = None

    @property
    def serves_tls(self) -> bool:
        return self.cert is not None
