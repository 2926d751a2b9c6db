"""A development CA: one command makes a CA, a server certificate and a client certificate.

    python -m pdserve.security.certs --out certs/ --host localhost --host 127.0.0.1 --host 10.0.0.5

writes into --out:

    ca.pem       ca-key.pem        the CA (basicConstraints CA:TRUE, path length 0)
    server.pem   server-key.pem    signed by the CA; EKU serverAuth; SANs = every --host
    client.pem   client-key.pem    signed by the CA; EKU clientAuth (for mutual TLS)

Keys are EC P-256, unencrypted PKCS#8, mode 0600. The certificates must name every host
or IP address clients dial (gRPC checks the SAN against the target), so list each
machine's address when workers run on more than one host.

FOR DEVELOPMENT ONLY: the CA key lies next to the certificates, and anyone holding it
can mint certificates this cluster trusts. Use your organisation's CA in production.

Needs the `cryptography` package (imported here only, so serving does not need it).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.security.tls import TLSConfig

DEFAULT_HOSTS = ("localhost", "127.0.0.1")
FILE_NAMES = ("ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem")
DEV_ONLY_NOTE = ("NOTE: this CA is for development only. ca-key.pem can mint certificates that this "
                 "cluster trusts; keep it private, and use your organisation's CA in production.")


@dataclass(frozen=True)
class DevCerts:
    out_dir: str
    ca: str
    ca_key: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    def server_tls(self, require_client_cert: bool = False) -> TLSConfig:
        """The TLSConfig a server uses with these files (mutual TLS when require_client_cert)."""
        return TLSConfig(self.server_cert, self.server_key, self.ca, require_client_cert)


def _san_entries(hosts: Sequence[str]):
    from cryptography import x509

    entries = []
    for host in hosts:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            entries.append(x509.DNSName(host))
    return entries


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)  # O_CREAT's mode does not apply to a file that already existed
        os.write(fd, data)
    finally:
        os.close(fd)


def make_dev_ca(out_dir: str | os.PathLike[str], hosts: Sequence[str] = DEFAULT_HOSTS, days: int = 30, *,
                overwrite: bool = False) -> DevCerts:
    """Write a development CA and a server and a client certificate into out_dir; returns their paths."""
    from cryptography.x509.oid import ExtendedKeyUsageOID

    hosts = tuple(hosts)
    if not hosts:
        raise ValueError("give at least one --host: the server certificate must name what clients dial")
    if days < 1:
        raise ValueError(f"--days must be at least 1, got {days}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    existing = [name for name in FILE_NAMES if (out / name).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{out} already holds {', '.join(existing)}; pass --force to replace them "
                              "(clients trusting the old CA will then be refused)")

    validity = _Validity.days_from_now(days)
    ca_key, ca_cert = _ca_certificate(validity)
    server_key, server_cert = _leaf_certificate(ca_key, ca_cert, hosts[0], ExtendedKeyUsageOID.SERVER_AUTH,
                                                _san_entries(hosts), validity)
    client_key, client_cert = _leaf_certificate(ca_key, ca_cert, "pdserve-client",
                                                ExtendedKeyUsageOID.CLIENT_AUTH, [], validity)
    contents = {"ca.pem": _pem_cert(ca_cert), "ca-key.pem": _pem_key(ca_key),
                "server.pem": _pem_cert(server_cert), "server-key.pem": _pem_key(server_key),
                "client.pem": _pem_cert(client_cert), "client-key.pem": _pem_key(client_key)}
    for file_name, data in contents.items():
        _write(out / file_name, data, 0o600 if file_name.endswith("-key.pem") else 0o644)
    paths = [str(out / file_name) for file_name in FILE_NAMES]
    return DevCerts(str(out), *paths)


@dataclass(frozen=True)
class _Validity:
    not_before: datetime.datetime
    not_after: datetime.datetime

    @classmethod
    def days_from_now(cls, days: int) -> _Validity:
        now = datetime.datetime.now(datetime.UTC)
        # NOTE: from a few minutes ago, to tolerate small clock skew between machines.
        return cls(now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days))


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve development"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_usage(ca: bool):
    """Signatures only; a CA also signs certificates and revocation lists."""
    from cryptography import x509

    return x509.KeyUsage(digital_signature=True, key_cert_sign=ca, crl_sign=ca, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                         encipher_only=False, decipher_only=False)


def _ca_certificate(validity: _Validity) -> tuple:
    """(key, self-signed certificate) of a CA that signs leaf certificates only (path length 0)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("pdserve development CA")
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(validity.not_before).not_valid_after(validity.not_after)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf_certificate(ca_key, ca_cert, common_name: str, usage, sans: list, validity: _Validity) -> tuple:
    """(key, certificate) for one use (serverAuth or clientAuth), signed by the CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(validity.not_before).not_valid_after(validity.not_after)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(_key_usage(ca=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                              critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pem_cert(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.security.certs",
        description="Make a development CA plus a server and a client certificate for pdserve's gRPC TLS. "
                    "Writes ca.pem, ca-key.pem, server.pem, server-key.pem, client.pem, client-key.pem "
                    "(EC P-256; keys mode 0600). For development only: use your organisation's CA in "
                    "production.")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="directory to write the six PEM files into (created if missing)")
    parser.add_argument("--host", action="append", metavar="H", dest="hosts",
                        help="a DNS name or IP address clients dial, put into the server certificate's "
                             "subjectAltName; repeat for each (default: localhost and 127.0.0.1)")
    parser.add_argument("--days", type=int, default=30,
                        help="how many days the certificates stay valid (default: 30)")
    parser.add_argument("--force", action="store_true",
                        help="replace files already in --out (clients trusting the old CA are then refused)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        certs = make_dev_ca(args.out, tuple(args.hosts or DEFAULT_HOSTS), args.days, overwrite=args.force)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote a development CA and certificates for {', '.join(args.hosts or DEFAULT_HOSTS)} "
          f"(valid {args.days} days) to {certs.out_dir}:")
    for path in (certs.ca, certs.ca_key, certs.server_cert, certs.server_key, certs.client_cert,
                 certs.client_key):
        print(f"  {path}")
    print(f"servers: --tls-cert {certs.server_cert} --tls-key {certs.server_key} --tls-ca {certs.ca} "
          "[--tls-require-client-cert]")
    print(DEV_ONLY_NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
