"""Bearer tokens and the cluster secret: refused before the handler runs, for every call kind."""

from __future__ import annotations

import grpc
import pytest

from pdserve.security.auth import (
    AUTHORIZATION_KEY,
    CLUSTER_SECRET_KEY,
    BearerTokenInterceptor,
    ClusterSecretInterceptor,
)
from pdserve.security.tls import open_channel
from tests.security.conftest import METHODS, call, health_check

TOKEN = "tok-public-0123456789"
OTHER_TOKEN = "tok-public-second-key"
SECRET = "cluster-secret-abcdef012345"
EXPECTED = {"Unary": [b"echo:a"], "Stream": [b"a0", b"a1", b"a2"], "Collect": [b"a+b"],
            "Chat": [b"echo:a", b"echo:b"]}


def refused(channel, method, metadata=None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call(channel, method, metadata=metadata)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    return e.value


@pytest.fixture
def public_server(tiny_server_factory):
    return tiny_server_factory(interceptors=[BearerTokenInterceptor([TOKEN, OTHER_TOKEN])])


@pytest.fixture
def internal_server(tiny_server_factory):
    return tiny_server_factory(interceptors=[ClusterSecretInterceptor(SECRET)])


@pytest.mark.parametrize("method", METHODS)
def test_missing_token_is_refused_before_the_handler(public_server, method):
    with open_channel(f"127.0.0.1:{public_server.port}", None) as channel:
        error = refused(channel, method)
    assert "missing bearer token" in error.details()
    assert public_server.calls == []


@pytest.mark.parametrize("method", METHODS)
def test_wrong_token_is_refused_and_not_echoed(public_server, method):
    with open_channel(f"127.0.0.1:{public_server.port}", None) as channel:
        error = refused(channel, method, [(AUTHORIZATION_KEY, "Bearer not-the-token")])
    assert "invalid bearer token" in error.details()
    assert "not-the-token" not in error.details()
    assert public_server.calls == []


@pytest.mark.parametrize("method", METHODS)
def test_right_token_reaches_the_handler(public_server, method):
    with open_channel(f"127.0.0.1:{public_server.port}", None) as channel:
        for header in (f"Bearer {TOKEN}", f"bearer {OTHER_TOKEN}"):  # the scheme is case-insensitive
            assert call(channel, method, metadata=[(AUTHORIZATION_KEY, header)]) == EXPECTED[method]
    assert public_server.called == [method, method]


@pytest.mark.parametrize("header", ["Basic dXNlcjpwYXNz", TOKEN, "Bearer ", "Bearer"])
def test_malformed_authorization_is_refused(public_server, header):
    with open_channel(f"127.0.0.1:{public_server.port}", None) as channel:
        error = refused(channel, "Unary", [(AUTHORIZATION_KEY, header)])
    assert "malformed authorization" in error.details()
    assert public_server.calls == []


def test_token_prefix_or_extension_is_refused(public_server):
    with open_channel(f"127.0.0.1:{public_server.port}", None) as channel:
        for near in (TOKEN[:-1], TOKEN + "x"):
            refused(channel, "Unary", [(AUTHORIZATION_KEY, f"Bearer {near}")])
    assert public_server.calls == []


def test_health_is_exempt(public_server, internal_server):
    for server in (public_server, internal_server):
        with open_channel(f"127.0.0.1:{server.port}", None) as channel:
            assert health_check(channel) == 1  # SERVING, with no credentials


def test_unknown_method_stays_unimplemented(public_server):
    with open_channel(f"127.0.0.1:{public_server.port}", None) as channel:
        with pytest.raises(grpc.RpcError) as e:
            channel.unary_unary("/pdserve.test.Echo/Nope")(b"x", timeout=5)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("method", METHODS)
def test_cluster_secret_gate(internal_server, method):
    with open_channel(f"127.0.0.1:{internal_server.port}", None) as channel:
        assert "missing cluster secret" in refused(channel, method).details()
        wrong = refused(channel, method, [(CLUSTER_SECRET_KEY, "guess-123")])
        assert "wrong cluster secret" in wrong.details() and "guess-123" not in wrong.details()
        assert internal_server.calls == []
        assert call(channel, method, metadata=[(CLUSTER_SECRET_KEY, SECRET)]) == EXPECTED[method]
    assert internal_server.called == [method]


def test_a_public_token_does_not_open_an_internal_service(internal_server, public_server):
    with open_channel(f"127.0.0.1:{internal_server.port}", None) as channel:
        refused(channel, "Unary", [(AUTHORIZATION_KEY, f"Bearer {SECRET}")])
        refused(channel, "Unary", [(CLUSTER_SECRET_KEY, TOKEN)])
    with open_channel(f"127.0.0.1:{public_server.port}", None) as channel:
        refused(channel, "Unary", [(CLUSTER_SECRET_KEY, SECRET)])
    assert internal_server.calls == [] and public_server.calls == []


def test_gates_refuse_bad_configuration():
    with pytest.raises(ValueError, match="at least one token"):
        BearerTokenInterceptor([])
    with pytest.raises(ValueError, match="cluster secret is empty"):
        ClusterSecretInterceptor("")
    with pytest.raises(ValueError, match="printable ASCII without spaces"):
        BearerTokenInterceptor(["two words"])
