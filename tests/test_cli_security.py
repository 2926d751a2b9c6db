"""The client security flags: the same on every command that dials the router, read into a SecurityConfig.
(Against a real TLS router with tokens: tests/router/test_secure_router.py.)"""

from __future__ import annotations

import pytest

from deploy.cli import build_parser, main
from pdserve.client_security import client_kwargs, security_from_args
from pdserve.security import SecurityConfig, TLSConfig

CLIENT_FLAGS = ("--tls-ca", "--tls-client-cert", "--tls-client-key", "--api-token-file", "--api-token-env")
COMMANDS = (["generate", "--router", "127.0.0.1:1"], ["chat"], ["status"], ["audit"], ["loadtest"])


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", [c[0] for c in COMMANDS])
def test_every_client_command_documents_the_same_flags(command, capsys):
    with pytest.raises(SystemExit):
        parse(command, "--help")
    out = capsys.readouterr().out
    assert all(flag in out for flag in CLIENT_FLAGS), out
    assert "security:" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_no_flag_means_plaintext_without_a_token(command):
    assert security_from_args(parse(*command)) == SecurityConfig()


def test_the_flags_make_a_client_config(dev_certs, tmp_path):
    token = tmp_path / "token.txt"
    token.write_text("# mine\ntok-123\n")
    args = parse("status", "--tls-ca", dev_certs.ca, "--tls-client-cert", dev_certs.client_cert,
                 "--tls-client-key", dev_certs.client_key, "--api-token-file", str(token))
    security = security_from_args(args)
    assert security == SecurityConfig(tls=TLSConfig(ca=dev_certs.ca), client_cert=dev_certs.client_cert,
                                      client_key=dev_certs.client_key, api_tokens=("tok-123",))
    kwargs = client_kwargs(security)
    assert kwargs["metadata"] == (("authorization", "Bearer tok-123"),)
    assert kwargs["credentials"] is not None


def test_the_token_from_a_named_variable(monkeypatch):
    monkeypatch.setenv("MY_PDSERVE_TOKEN", "tok-456")
    security = security_from_args(parse("chat", "--api-token-env", "MY_PDSERVE_TOKEN"))
    assert security.api_tokens == ("tok-456",) and security.tls is None


@pytest.mark.parametrize("argv, message", [
    (["status", "--api-token-env", "PDSERVE_SURELY_UNSET_VARIABLE"],
     "API token: environment variable PDSERVE_SURELY_UNSET_VARIABLE is not set"),
    (["status", "--tls-ca", "/nonexistent/ca.pem"], "--tls-ca /nonexistent/ca.pem: no such file"),
    (["generate", "--tls-ca", "/nonexistent/ca.pem", "hi"],
     "--tls-ca apply to --router only: --local runs the engine in this process"),
])
def test_bad_security_flags_are_usage_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_client_token_file_holds_one_token(tmp_path, dev_certs, capsys):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("tok-a\ntok-b\n")
    assert main(["status", "--api-token-file", str(tokens)]) == 2
    assert f"API token file {tokens} holds 2 values; expected exactly one" in capsys.readouterr().err
    assert main(["status", "--tls-client-cert", dev_certs.client_cert, "--tls-client-key",
                 dev_certs.client_key]) == 2
    assert "--tls-client-cert needs TLS (--tls-ca)" in capsys.readouterr().err


def test_a_token_file_and_a_token_variable_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        parse("status", "--api-token-file", "t.txt", "--api-token-env", "T")
    assert "not allowed with argument" in capsys.readouterr().err
