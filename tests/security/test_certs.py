"""The development CA: file set, modes, extensions, refusal to overwrite, and the CLI."""

from __future__ import annotations

import ipaddress
import os
import stat
import subprocess
import sys

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from pdserve.security.certs import FILE_NAMES, main, make_dev_ca


def load(path: str) -> x509.Certificate:
    with open(path, "rb") as f:
        return x509.load_pem_x509_certificate(f.read())


def test_files_modes_and_extensions(tmp_path):
    certs = make_dev_ca(tmp_path / "ca", hosts=("localhost", "127.0.0.1", "node-1.internal", "::1"), days=3)
    assert sorted(os.listdir(certs.out_dir)) == sorted(FILE_NAMES)
    for key in (certs.ca_key, certs.server_key, certs.client_key):
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    ca, server, client = load(certs.ca), load(certs.server_cert), load(certs.client_cert)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert isinstance(server.public_key(), ec.EllipticCurvePublicKey)
    assert server.public_key().curve.name == "secp256r1"
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost", "node-1.internal"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"),
                                                        ipaddress.ip_address("::1")]
    assert list(server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH]
    assert list(client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH]
    for leaf in (server, client):
        assert leaf.issuer == ca.subject
        leaf.verify_directly_issued_by(ca)
        assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert (server.not_valid_after_utc - server.not_valid_before_utc).days == 3


def test_refuses_to_overwrite_without_force(tmp_path):
    first = make_dev_ca(tmp_path)
    with pytest.raises(FileExistsError, match="pass --force"):
        make_dev_ca(tmp_path)
    second = make_dev_ca(tmp_path, overwrite=True)
    assert load(second.ca).serial_number != 0 and first.ca == second.ca


def test_cli_help_explains_every_flag():
    result = subprocess.run([sys.executable, "-m", "pdserve.security.certs", "--help"],
                            capture_output=True, text=True, timeout=60, check=True)
    for flag in ("--out", "--host", "--days", "--force"):
        assert flag in result.stdout
    assert "development only" in result.stdout.replace("\n", " ").lower()


def test_cli_run_writes_the_files_and_warns(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "dev"), "--host", "localhost", "--host", "10.0.0.7"]) == 0
    out = capsys.readouterr().out
    assert "for development only" in out and "--tls-cert" in out
    assert sorted(os.listdir(tmp_path / "dev")) == sorted(FILE_NAMES)
    sans = load(str(tmp_path / "dev" / "server.pem")).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]
    assert main(["--out", str(tmp_path / "dev")]) == 2  # already there, no --force
    assert "pass --force" in capsys.readouterr().err
