"""SecurityConfig composition and validation; reading tokens and secrets from files and the environment."""

from __future__ import annotations

import pytest

from pdserve.security.auth import (
    BearerTokenInterceptor,
    ClusterSecretInterceptor,
    read_secret,
    read_secrets_file,
)
from pdserve.security.config import SecurityConfig, is_loopback
from pdserve.security.tls import TLSConfig


def test_default_config_adds_nothing():
    config = SecurityConfig()
    assert config.server_interceptors(public=True) == []
    assert config.server_interceptors(public=False) == []
    assert config.client_interceptors(internal=True) == []
    assert config.client_interceptors(internal=False, aio=True) == []


def test_public_and_internal_gates_are_distinct():
    config = SecurityConfig(api_tokens=("tok-a", "tok-b"), cluster_secret="secret-1")
    [public] = config.server_interceptors(public=True)
    [internal] = config.server_interceptors(public=False)
    assert isinstance(public, BearerTokenInterceptor)
    assert isinstance(internal, ClusterSecretInterceptor)
    assert len(config.client_interceptors(internal=True, aio=True)) == 4  # one per aio call kind


def test_a_client_presents_one_token():
    with pytest.raises(ValueError, match="a client presents one API token; this config holds 2"):
        SecurityConfig(api_tokens=("tok-a", "tok-b")).client_interceptors(internal=False)


def test_client_metadata_carries_the_credential_for_the_side_dialled():
    config = SecurityConfig(api_tokens=("tok-a",), cluster_secret="secret-1")
    assert config.client_metadata(internal=False) == (("authorization", "Bearer tok-a"),)
    assert config.client_metadata(internal=True) == (("x-pdserve-cluster-secret", "secret-1"),)
    assert SecurityConfig().client_metadata(internal=False) == ()
    with pytest.raises(ValueError, match="a client presents one API token"):
        SecurityConfig(api_tokens=("tok-a", "tok-b")).client_metadata(internal=False)


def test_channel_credentials_only_with_tls(dev_certs):
    assert SecurityConfig().channel_credentials() is None
    assert SecurityConfig(tls=TLSConfig(ca=dev_certs.ca)).channel_credentials() is not None


def test_describe_and_repr_never_show_a_credential(dev_certs):
    config = SecurityConfig(tls=dev_certs.server_tls(), api_tokens=("tok-a",), cluster_secret="secret-1")
    assert config.describe() == "TLS on · 1 API token · cluster secret on"
    assert "tok-a" not in repr(config) and "secret-1" not in repr(config)


def test_cluster_secret_must_differ_from_api_tokens():
    with pytest.raises(ValueError, match="cluster secret must differ from every API token"):
        SecurityConfig(api_tokens=("same",), cluster_secret="same")


def test_client_certificate_needs_tls(dev_certs):
    with pytest.raises(ValueError, match="--tls-client-cert needs TLS"):
        SecurityConfig(client_cert=dev_certs.client_cert, client_key=dev_certs.client_key)
    with pytest.raises(ValueError, match="--tls-client-key given without --tls-client-cert"):
        SecurityConfig(tls=TLSConfig(ca=dev_certs.ca), client_key=dev_certs.client_key)


def test_exposure_warnings_only_off_loopback():
    assert SecurityConfig().exposure_warnings("127.0.0.1", public=True) == []
    assert SecurityConfig().exposure_warnings("localhost", public=False) == []
    public = SecurityConfig().exposure_warnings("0.0.0.0", public=True)
    assert [w.split(":")[0] for w in public] == ["the public API on 0.0.0.0 without TLS",
                                                 "the public API on 0.0.0.0 without --api-token-file"]
    internal = SecurityConfig(cluster_secret="s-1").exposure_warnings("10.0.0.5", public=False)
    assert internal == ["internal services on 10.0.0.5 without TLS: traffic, tokens and secrets travel in "
                        "clear text (--tls-cert/--tls-key)"]


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("127.0.1.1", True), ("::1", True),
                                                ("[::1]", True), ("LOCALHOST", True), ("0.0.0.0", False),
                                                ("", False), ("::", False), ("10.1.2.3", False),
                                                ("example.com", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_read_secrets_file_skips_comments_and_blank_lines(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# team A\ntok-a\n\n  tok-b  \n")
    assert read_secrets_file(str(path)) == ("tok-a", "tok-b")
    with pytest.raises(ValueError, match="holds 2 values; expected exactly one"):
        read_secret(file=str(path), what="cluster secret")


def test_read_secret_from_file_or_named_variable(tmp_path):
    path = tmp_path / "secret"
    path.write_text("s3cret-value\n")
    assert read_secret(file=str(path)) == "s3cret-value"
    environ = {"PDSERVE_TEST_SECRET": "from-env\n"}
    assert read_secret(env_name="PDSERVE_TEST_SECRET", environ=environ) == "from-env"
    assert read_secret() is None


def test_read_secret_errors_name_the_source(tmp_path):
    with pytest.raises(ValueError, match="cluster secret: environment variable NOPE is not set"):
        read_secret(env_name="NOPE", environ={}, what="cluster secret")
    with pytest.raises(ValueError, match="not both"):
        read_secret(file="x", env_name="Y", environ={})
    empty = tmp_path / "empty"
    empty.write_text("# nothing here\n\n")
    with pytest.raises(ValueError, match=f"token file {empty} holds no token"):
        read_secrets_file(str(empty))
    with pytest.raises(ValueError, match="no such file"):
        read_secrets_file(str(tmp_path / "missing"))
    spaced = tmp_path / "spaced"
    spaced.write_text("two words\n")
    with pytest.raises(ValueError, match="printable ASCII without spaces"):
        read_secrets_file(str(spaced))
