"""Client interceptors attach the credentials to every call, on plaintext and TLS, sync and aio."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from pdserve.security.auth import (
    AUTHORIZATION_KEY,
    CLUSTER_SECRET_KEY,
    BearerTokenInterceptor,
    ClusterSecretInterceptor,
    metadata_interceptors,
)
from pdserve.security.config import SecurityConfig
from pdserve.security.tls import TLSConfig, open_channel
from tests.security.conftest import METHODS, call, path

TOKEN = "tok-public-0123456789"
SECRET = "cluster-secret-abcdef012345"


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_sync_interceptors_send_token_and_secret_on_every_call_kind(dev_certs, tiny_server_factory, tls):
    gates = [BearerTokenInterceptor([TOKEN]), ClusterSecretInterceptor(SECRET)]
    server = tiny_server_factory(tls=dev_certs.server_tls() if tls else None, interceptors=gates)
    interceptors = metadata_interceptors(token=TOKEN, cluster_secret=SECRET)
    client_tls = TLSConfig(ca=dev_certs.ca) if tls else None
    with open_channel(f"localhost:{server.port}", client_tls, interceptors=interceptors) as channel:
        for method in METHODS:
            call(channel, method, metadata=[("x-request-id", "r1")])
    assert server.called == list(METHODS)
    for _, metadata in server.calls:
        assert metadata[AUTHORIZATION_KEY] == f"Bearer {TOKEN}"
        assert metadata[CLUSTER_SECRET_KEY] == SECRET
        assert metadata["x-request-id"] == "r1"  # the caller's own metadata is kept


def test_interceptor_replaces_a_stale_credential(tiny_server_factory):
    server = tiny_server_factory(interceptors=[ClusterSecretInterceptor(SECRET)])
    with open_channel(f"127.0.0.1:{server.port}", None,
                      interceptors=metadata_interceptors(cluster_secret=SECRET)) as channel:
        call(channel, "Unary", metadata=[(CLUSTER_SECRET_KEY, "old-secret")])
    assert server.calls[0][1][CLUSTER_SECRET_KEY] == SECRET


def test_no_credentials_means_no_interceptors():
    assert metadata_interceptors() == []
    assert metadata_interceptors(aio=True) == []


async def _aio_calls(target: str, config: SecurityConfig, bare: SecurityConfig) -> list[list[bytes]]:
    async with config.open_channel(target, internal=True, aio=True) as channel:
        unary = await channel.unary_unary(path("Unary"))(b"a", timeout=5)
        stream = [r async for r in channel.unary_stream(path("Stream"))(b"a", timeout=5)]
        collect = await channel.stream_unary(path("Collect"))(iter([b"a", b"b"]), timeout=5)
        chat = [r async for r in channel.stream_stream(path("Chat"))(iter([b"a"]), timeout=5)]
    async with bare.open_channel(target, internal=True, aio=True) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await channel.unary_unary(path("Unary"))(b"a", timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    return [[unary], stream, [collect], chat]


def test_aio_interceptors_over_mutual_tls(dev_certs, tiny_server_factory):
    server = tiny_server_factory(tls=dev_certs.server_tls(require_client_cert=True),
                                 interceptors=[ClusterSecretInterceptor(SECRET)])
    bare = SecurityConfig(tls=TLSConfig(ca=dev_certs.ca), client_cert=dev_certs.client_cert,
                          client_key=dev_certs.client_key)
    config = dataclasses.replace(bare, cluster_secret=SECRET)
    assert asyncio.run(_aio_calls(f"localhost:{server.port}", config, bare)) == [
        [b"echo:a"], [b"a0", b"a1", b"a2"], [b"a+b"], [b"echo:a"]]
    assert server.called == ["Unary", "Stream", "Collect", "Chat"]
    assert all(metadata[CLUSTER_SECRET_KEY] == SECRET for _, metadata in server.calls)


def test_aio_interceptors_on_plaintext(tiny_server_factory):
    server = tiny_server_factory(interceptors=[BearerTokenInterceptor([TOKEN])])
    config = SecurityConfig(api_tokens=(TOKEN,))

    async def run() -> bytes:
        async with config.open_channel(f"127.0.0.1:{server.port}", internal=False, aio=True) as channel:
            return await channel.unary_unary(path("Unary"))(b"a", timeout=5)

    assert asyncio.run(run()) == b"echo:a"
    assert server.calls[0][1][AUTHORIZATION_KEY] == f"Bearer {TOKEN}"
