"""TLS and mutual TLS over real loopback sockets, with the dev CA."""

from __future__ import annotations

import grpc
import pytest

from pdserve.security.tls import TLSConfig, open_channel
from tests.security.conftest import call, health_check


def test_client_trusting_the_ca_connects(dev_certs, tiny_server_factory):
    server = tiny_server_factory(tls=dev_certs.server_tls())
    with open_channel(f"localhost:{server.port}", TLSConfig(ca=dev_certs.ca)) as channel:
        assert call(channel, "Unary") == [b"echo:a"]
        assert health_check(channel) == 1  # SERVING
    assert server.called == ["Unary"]


def test_ip_address_target_matches_the_ip_san(dev_certs, tiny_server_factory):
    server = tiny_server_factory(tls=dev_certs.server_tls())
    with open_channel(f"127.0.0.1:{server.port}", TLSConfig(ca=dev_certs.ca)) as channel:
        assert call(channel, "Stream") == [b"a0", b"a1", b"a2"]


def test_host_not_in_the_certificate_is_refused(dev_certs, tiny_server_factory, tmp_path):
    from pdserve.security.certs import make_dev_ca

    other = make_dev_ca(tmp_path, hosts=("pdserve.example",))
    server = tiny_server_factory(tls=other.server_tls())
    with open_channel(f"localhost:{server.port}", TLSConfig(ca=other.ca)) as channel:
        with pytest.raises(grpc.RpcError) as e:
            call(channel, "Unary")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    options = [("grpc.ssl_target_name_override", "pdserve.example")]
    with open_channel(f"localhost:{server.port}", TLSConfig(ca=other.ca), options) as channel:
        assert call(channel, "Unary") == [b"echo:a"]


def test_client_without_the_ca_is_refused(dev_certs, tiny_server_factory):
    server = tiny_server_factory(tls=dev_certs.server_tls())
    with open_channel(f"localhost:{server.port}", TLSConfig()) as channel:  # system roots only
        with pytest.raises(grpc.RpcError) as e:
            call(channel, "Unary")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert server.calls == []


def test_plaintext_client_cannot_talk_to_a_tls_server(dev_certs, tiny_server_factory):
    server = tiny_server_factory(tls=dev_certs.server_tls())
    with open_channel(f"localhost:{server.port}", None) as channel:
        with pytest.raises(grpc.RpcError) as e:
            call(channel, "Unary")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert server.calls == []


def test_mutual_tls_refuses_a_client_without_a_certificate(dev_certs, tiny_server_factory):
    server = tiny_server_factory(tls=dev_certs.server_tls(require_client_cert=True))
    with open_channel(f"localhost:{server.port}", TLSConfig(ca=dev_certs.ca)) as channel:
        with pytest.raises(grpc.RpcError) as e:
            call(channel, "Unary")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert server.calls == []


def test_mutual_tls_accepts_the_client_certificate(dev_certs, tiny_server_factory):
    server = tiny_server_factory(tls=dev_certs.server_tls(require_client_cert=True))
    with open_channel(f"localhost:{server.port}", TLSConfig(ca=dev_certs.ca),
                      client_cert=dev_certs.client_cert, client_key=dev_certs.client_key) as channel:
        assert call(channel, "Collect") == [b"a+b"]
    assert server.called == ["Collect"]


def test_mutual_tls_refuses_a_certificate_from_another_ca(dev_certs, tiny_server_factory, tmp_path):
    from pdserve.security.certs import make_dev_ca

    stranger = make_dev_ca(tmp_path)
    server = tiny_server_factory(tls=dev_certs.server_tls(require_client_cert=True))
    with open_channel(f"localhost:{server.port}", TLSConfig(ca=dev_certs.ca),
                      client_cert=stranger.client_cert, client_key=stranger.client_key) as channel:
        with pytest.raises(grpc.RpcError) as e:
            call(channel, "Unary")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert server.calls == []


# --- validation at the boundary ---------------------------------------------------------------

def test_cert_without_key_names_the_missing_flag(dev_certs):
    with pytest.raises(ValueError, match="--tls-cert given without --tls-key"):
        TLSConfig(cert=dev_certs.server_cert)
    with pytest.raises(ValueError, match="--tls-key given without --tls-cert"):
        TLSConfig(key=dev_certs.server_key)


def test_missing_file_is_named(dev_certs, tmp_path):
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ValueError, match=f"--tls-ca {missing}: no such file"):
        TLSConfig(ca=missing)
    with pytest.raises(ValueError, match=f"--tls-key {missing}: no such file"):
        TLSConfig(cert=dev_certs.server_cert, key=missing)


def test_require_client_cert_needs_a_ca_and_a_server_certificate(dev_certs):
    with pytest.raises(ValueError, match="--tls-require-client-cert needs --tls-ca"):
        TLSConfig(dev_certs.server_cert, dev_certs.server_key, require_client_cert=True)
    with pytest.raises(ValueError, match="needs --tls-cert and --tls-key"):
        TLSConfig(ca=dev_certs.ca, require_client_cert=True)


def test_serving_needs_a_certificate(dev_certs):
    with pytest.raises(ValueError, match="serving TLS needs --tls-cert and --tls-key"):
        TLSConfig(ca=dev_certs.ca).server_credentials()


def test_client_cert_without_key_names_the_flag(dev_certs):
    with pytest.raises(ValueError, match="--tls-client-cert given without --tls-client-key"):
        TLSConfig(ca=dev_certs.ca).channel_credentials(client_cert=dev_certs.client_cert)
