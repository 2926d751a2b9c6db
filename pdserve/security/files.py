"""TLSFiles: a cluster's TLS files as paths, the one declaration the launcher and every worker share.

Pure (no grpc): deploy/config.py composes it into ClusterSpec and checks a file in milliseconds;
a worker receives it in its WorkerSpec and reads the files on its own node, through
SecurityConfig.of_files (pdserve/security/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.settings import setting


@dataclass(frozen=True)
class TLSFiles:
    """The TLS files the router and every worker serve and trust; none given = plaintext.

    Which settings go together is checked by the front end that names them for its user
    (deploy/config.py); whether the files exist, when they are read."""

    cert: str | None = setting(None, flag="--tls-cert", key="tls.cert", is_path=True, metavar="FILE",
                               help="serve TLS on the router and every worker with this certificate (with "
                                    "tls.key); it must name every address clients and workers dial")
    key: str | None = setting(None, flag="--tls-key", key="tls.key", is_path=True, metavar="FILE",
                              help="private key of tls.cert")
    ca: str | None = setting(None, flag="--tls-ca", key="tls.ca", is_path=True, metavar="FILE",
                             help="the CA the router and workers trust when they dial each other, and that "
                                  "signs client certificates under tls.require_client_cert")
    require_client_cert: bool = setting(
        False, flag="--tls-require-client-cert", key="tls.require_client_cert",
        help="mutual TLS: refuse clients without a certificate signed by tls.ca; needs tls.client_cert and "
             "tls.client_key for the cluster's own calls")
    client_cert: str | None = setting(None, flag="--tls-client-cert", key="tls.client_cert", is_path=True,
                                      metavar="FILE",
                                      help="certificate the router and prefill workers present to workers "
                                           "under mutual TLS (client.pem from the development CA)")
    client_key: str | None = setting(None, flag="--tls-client-key", key="tls.client_key", is_path=True,
                                     metavar="FILE", help="private key of tls.client_cert")

    @property
    def serves_tls(self) -> bool:
        return self.cert is not None
