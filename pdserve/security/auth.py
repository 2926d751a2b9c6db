"""Shared-secret authentication in gRPC metadata: server gates and the client side that sends it.

Two gates, same mechanics, different credentials:

    BearerTokenInterceptor     public API   metadata `authorization: Bearer <token>`
    ClusterSecretInterceptor   internal     metadata `x-pdserve-cluster-secret: <secret>`

A gate runs before the method's handler: on a missing or wrong credential it returns a
handler of the same kind (unary/streaming in, unary/streaming out) that only aborts with
UNAUTHENTICATED, so the real handler is never called and a streaming request is never
read. Health and reflection stay open (EXEMPT_METHODS) so probes and `grpcurl list`
work without credentials; neither reveals anything beyond the published protos.

Credentials are compared with hmac.compare_digest against every allowed value, and
error messages say what was missing or malformed, never the value received.

Client side: metadata_interceptors() adds the metadata to every call. Interceptors (not
grpc.access_token_call_credentials) are used because call credentials are only sent over
TLS channels, and the cluster must also work on plaintext loopback.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import grpc

AUTHORIZATION_KEY = "authorization"
CLUSTER_SECRET_KEY = "x-pdserve-cluster-secret"
EXEMPT_METHODS = (
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
)


# --- reading secrets --------------------------------------------------------------------------

def check_secret(value: str, what: str) -> str:
    """value if it can travel as a gRPC metadata value (printable ASCII, no spaces); else ValueError."""
    if not value:
        raise ValueError(f"{what} is empty")
    if not all(33 <= ord(c) <= 126 for c in value):
        raise ValueError(f"{what} must be printable ASCII without spaces (it travels in gRPC metadata)")
    return value


def read_secret(*, file: str | None = None, env_name: str | None = None,
                environ: Mapping[str, str] | None = None, what: str = "secret") -> str | None:
    """A token or secret from a file (first non-comment line) or the environment variable env_name.

    Give at most one source; None when neither is given. environ defaults to os.environ and is
    read only here, under the name the caller chose, e.g. read_secret(file=args.cluster_secret_file).
    """
    if file is not None and env_name is not None:
        raise ValueError(f"give the {what} as a file or as an environment variable, not both")
    if file is not None:
        values = read_secrets_file(file, what)
        if len(values) != 1:
            raise ValueError(f"{what} file {file} holds {len(values)} values; expected exactly one")
        return values[0]
    if env_name is not None:
        env = os.environ if environ is None else environ
        if env_name not in env:
            raise ValueError(f"{what}: environment variable {env_name} is not set")
        return check_secret(env[env_name].strip(), f"{what} in ${env_name}")
    return None


def read_secrets_file(path: str, what: str = "token") -> tuple[str, ...]:
    """Every non-blank line of path that does not start with '#', stripped (e.g. several API tokens)."""
    try:
        with open(path, encoding="ascii") as f:
            lines = [line.strip() for line in f]
    except FileNotFoundError:
        raise ValueError(f"{what} file {path}: no such file") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} file {path}: not ASCII text") from None
    values = tuple(line for line in lines if line and not line.startswith("#"))
    if not values:
        raise ValueError(f"{what} file {path} holds no {what} (blank lines and # comments are skipped)")
    for n, value in enumerate(values, 1):
        check_secret(value, f"{what} #{n} in {path}")
    return values


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an `authorization: Bearer <token>` entry of a call's metadata, or None."""
    header = next((v for k, v in metadata or () if k == AUTHORIZATION_KEY), None)
    if not isinstance(header, str):
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def tenant_cache_salt(token: str) -> bytes:
    """The prefix-cache salt of the tenant an API token stands for (each token is a tenant of its
    own). A one-way digest: it names the tenant to the workers without handing them the token."""
    return hashlib.blake2b(token.encode("ascii"), digest_size=16, person=b"pdserve-tenant").digest()


# --- server side ------------------------------------------------------------------------------

def _matches(presented: str, allowed: Sequence[bytes]) -> bool:
    """Constant time in the presented value, and every allowed value is always compared."""
    candidate = presented.encode("ascii", "replace")
    ok = False
    for value in allowed:
        ok |= hmac.compare_digest(candidate, value)
    return ok


def _metadata_value(details: grpc.HandlerCallDetails, key: str) -> str | bytes | None:
    for k, v in details.invocation_metadata or ():
        if k == key:
            return v
    return None


def _aborting_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of handler's kind whose only act is to abort with UNAUTHENTICATED."""

    def abort(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(abort, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class _MetadataGate(grpc.ServerInterceptor):
    def __init__(self, exempt_methods: Collection[str]) -> None:
        self.exempt_methods = frozenset(exempt_methods)

    def refusal(self, details: grpc.HandlerCallDetails) -> str | None:
        """Why this call is refused; None when it may go on."""
        raise NotImplementedError

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method in self.exempt_methods:
            return handler  # None: gRPC answers UNIMPLEMENTED, as without the gate
        message = self.refusal(handler_call_details)
        return handler if message is None else _aborting_handler(handler, message)


class BearerTokenInterceptor(_MetadataGate):
    """Public API gate: `authorization: Bearer <token>` must carry one of tokens."""

    def __init__(self, tokens: Collection[str], exempt_methods: Collection[str] = EXEMPT_METHODS) -> None:
        super().__init__(exempt_methods)
        if not tokens:
            raise ValueError("BearerTokenInterceptor needs at least one token; leave the interceptor "
                             "out to serve without authentication")
        self._tokens = encoded_tokens(tokens)

    def refusal(self, details: grpc.HandlerCallDetails) -> str | None:
        return bearer_refusal(_metadata_value(details, AUTHORIZATION_KEY), self._tokens,
                              "send metadata 'authorization: Bearer <token>' (the pdserve CLI takes "
                              "--api-token-file FILE, PdserveClient metadata=)")


def bearer_refusal(header: str | bytes | None, allowed: Sequence[bytes], how_to_send: str) -> str | None:
    """Why an `authorization` value is refused (None: it carries one of the allowed tokens). The gRPC
    gate and the HTTP API both ask this; how_to_send is the fix for a missing header, in each one's terms."""
    if header is None:
        return f"missing bearer token: {how_to_send}"
    if not isinstance(header, str):
        return "the authorization value must be text, 'Bearer <token>'"
    token = bearer_token(((AUTHORIZATION_KEY, header),))
    if token is None:
        return "malformed authorization: expected 'Bearer <token>'"
    if not _matches(token, allowed):
        return "invalid bearer token: it matches none of the router's API tokens"
    return None


def encoded_tokens(tokens: Collection[str]) -> list[bytes]:
    return [check_secret(t, "API token").encode("ascii") for t in tokens]


class ClusterSecretInterceptor(_MetadataGate):
    """Internal-service gate: `x-pdserve-cluster-secret` must equal the cluster secret."""

    def __init__(self, secret: str, exempt_methods: Collection[str] = EXEMPT_METHODS) -> None:
        super().__init__(exempt_methods)
        self._secret = [check_secret(secret, "cluster secret").encode("ascii")]

    def refusal(self, details: grpc.HandlerCallDetails) -> str | None:
        value = _metadata_value(details, CLUSTER_SECRET_KEY)
        if value is None:
            return (f"internal pdserve service: missing cluster secret (metadata '{CLUSTER_SECRET_KEY}'); "
                    "only cluster members started with the same --cluster-secret-file may call it")
        if not isinstance(value, str) or not _matches(value, self._secret):
            return "internal pdserve service: wrong cluster secret"
        return None


# --- client side ------------------------------------------------------------------------------

class _CallDetails(
        collections.namedtuple("_CallDetails",
                               ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                "compression")),
        grpc.ClientCallDetails):
    pass


def _added(existing: Any, extra: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    keys = {k for k, _ in extra}
    return [(k, v) for k, v in (existing or ()) if k not in keys] + list(extra)


class _SyncMetadataInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                               grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(d.method, d.timeout, _added(d.metadata, self._metadata), d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def _aio_details(d: grpc.aio.ClientCallDetails,
                 extra: Sequence[tuple[str, str]]) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*_added(d.metadata, extra))
    return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)


# NOTE: grpc.aio files each interceptor under the first call kind it implements, so the aio
# side needs one object per kind where the sync side makes do with one.
class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_aio_details(client_call_details, self._metadata), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_aio_details(client_call_details, self._metadata), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_aio_details(client_call_details, self._metadata), request_iterator)


class _AioStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_aio_details(client_call_details, self._metadata), request_iterator)


def auth_metadata(token: str | None = None, cluster_secret: str | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata pairs that carry token and/or cluster_secret."""
    pairs: list[tuple[str, str]] = []
    if token is not None:
        pairs.append((AUTHORIZATION_KEY, f"Bearer {check_secret(token, 'API token')}"))
    if cluster_secret is not None:
        pairs.append((CLUSTER_SECRET_KEY, check_secret(cluster_secret, "cluster secret")))
    return tuple(pairs)


def metadata_interceptors(token: str | None = None, cluster_secret: str | None = None, *,
                          aio: bool = False) -> list[Any]:
    """Client interceptors that add the credentials to every call; [] when neither is given.

    Sync: pass them to grpc.intercept_channel(channel, *interceptors). aio: pass them as
    grpc.aio.*_channel(..., interceptors=...). tls.open_channel does either.
    """
    metadata = auth_metadata(token, cluster_secret)
    if not metadata:
        return []
    if aio:
        kinds = (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)
        return [kind(metadata) for kind in kinds]
    return [_SyncMetadataInterceptor(metadata)]
