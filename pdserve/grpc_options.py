"""gRPC options shared by every pdserve server and channel: message sizes and connection upkeep.

One place for the values, so the router, the workers and the channels between them agree:

    message sizes   64 MiB each way on internal links (a KV frame is at most max_chunk_bytes of
                    payload plus a small header); the router's public port receives at most
                    RequestLimits.max_message_bytes
    keepalive       a server pings a connection with calls on it every keepalive_time_s and
                    closes it when no answer comes within keepalive_timeout_s, so a client
                    that vanished (a dead host, a half-open TCP connection) frees its calls and
                    their KV blocks in about 40 s instead of at the call's deadline, or never
    ping policy     a server accepts client pings at most every min_client_ping_interval_s;
                    a client that pings faster is sent GOAWAY after max_ping_strikes
    idle / age      a connection with no call for max_connection_idle_s is closed; one older
                    than max_connection_age_s is asked to reconnect (GOAWAY: calls under way
                    finish, within max_connection_age_grace_s when that is set), so clients
                    behind a load balancer spread again after routers are added

Channels the router and the prefill workers dial ping every keepalive_time_s while they have
calls, and keep pinging through a long silent call (a Prefill waiting on its transfer). They
never ping an idle connection. NOTE: a client pinging faster than the server accepts gets
GOAWAY, so a policy is checked to ping no faster than it accepts: our clients and our
servers use the same ConnectionPolicy.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

MAX_MESSAGE_BYTES = 64 << 20

Options = list[tuple[str, int]]


def message_options(max_receive_bytes: int = MAX_MESSAGE_BYTES) -> Options:
    """Message size limits: send MAX_MESSAGE_BYTES, receive max_receive_bytes."""
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", max_receive_bytes)]


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


@dataclass(frozen=True)
class ConnectionPolicy:
    """Keepalive, ping policy and connection idle/age limits (see the module docstring)."""

    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    min_client_ping_interval_s: float = 10.0
    max_ping_strikes: int = 2
    max_connection_idle_s: float | None = 300.0  # None: an idle connection stays open
    max_connection_age_s: float | None = 1800.0  # None: a connection may live forever
    max_connection_age_grace_s: float | None = None  # None: calls under way finish however long

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not value > 0:
                raise ValueError(f"connection policy: {f.name} must be > 0, got {value}")
        if self.keepalive_time_s < self.min_client_ping_interval_s:
            raise ValueError(f"connection policy: keepalive_time_s ({self.keepalive_time_s:g}) must be >= "
                             f"min_client_ping_interval_s ({self.min_client_ping_interval_s:g}): our own "
                             "channels would ping faster than our servers accept, and be sent GOAWAY")

    def server_options(self) -> Options:
        options = [("grpc.keepalive_time_ms", _ms(self.keepalive_time_s)),
                   ("grpc.keepalive_timeout_ms", _ms(self.keepalive_timeout_s)),
                   # NOTE: 1 also lets clients ping an idle connection (at the interval below) without
                   # a strike; max_connection_idle_s still closes it.
                   ("grpc.keepalive_permit_without_calls", 1),
                   ("grpc.http2.min_ping_interval_without_data_ms", _ms(self.min_client_ping_interval_s)),
                   ("grpc.http2.max_ping_strikes", self.max_ping_strikes)]
        for name, value in (("grpc.max_connection_idle_ms", self.max_connection_idle_s),
                            ("grpc.max_connection_age_ms", self.max_connection_age_s),
                            ("grpc.max_connection_age_grace_ms", self.max_connection_age_grace_s)):
            if value is not None:
                options.append((name, _ms(value)))
        return options

    def channel_options(self) -> Options:
        return [("grpc.keepalive_time_ms", _ms(self.keepalive_time_s)),
                ("grpc.keepalive_timeout_ms", _ms(self.keepalive_timeout_s)),
                ("grpc.keepalive_permit_without_calls", 0),
                ("grpc.http2.max_pings_without_data", 0)]  # 0: keep pinging through a silent call


def server_options(policy: ConnectionPolicy, max_receive_bytes: int = MAX_MESSAGE_BYTES) -> Options:
    """Everything a pdserve server is built with: message sizes and the connection policy."""
    return message_options(max_receive_bytes) + policy.server_options()


def channel_options(policy: ConnectionPolicy | None = None) -> Options:
    """Everything a channel between pdserve processes is built with (policy None: the defaults)."""
    return message_options() + (policy or ConnectionPolicy()).channel_options()
