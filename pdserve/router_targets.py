"""Several router addresses as one gRPC channel: client-side load balancing and retry on another router.

    "10.0.0.5:50051"                  one router: the channel dials it as given
    "10.0.0.5:50051,10.0.0.6:50051"   replicas: one channel over all of them, round robin per call

With several routers the channel is given gRPC's own `round_robin` policy and a retry policy for
`pdserve.v1.Generation`: a call that fails UNAVAILABLE before any response arrived (its router is
down, draining, or unreachable) is retried, and round robin sends the retry to the next router. gRPC
never retries a stream once a response has been received, so no token is ever sent twice; a stream
cut after its first token fails as before.

Host names are resolved here, once, to the addresses gRPC's `ipv4:`/`ipv6:` targets take (gRPC's own
DNS resolver takes one name per target).
"""

from __future__ import annotations

import ipaddress
import json
import socket

RETRY_ATTEMPTS = 4  # the first try and up to 3 more, each on the next router
GENERATION_SERVICE = "pdserve.v1.Generation"


def split_targets(target: str) -> list[str]:
    """The HOST:PORT items of a comma-separated list; ValueError naming a malformed one."""
    items = [t.strip() for t in target.split(",")]
    if not items or any(not t for t in items):
        raise ValueError(f"router address {target!r}: give HOST:PORT, or several separated by commas")
    for item in items:
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"router address {item!r} is not HOST:PORT")
    return items


def channel_target(target: str) -> str:
    """What to dial: the target itself for one router, an `ipv4:`/`ipv6:` list for several."""
    items = split_targets(target)
    if len(items) == 1:
        return items[0]
    resolved = [_resolved(item) for item in items]
    families = {family for family, _ in resolved}
    if len(families) > 1:
        raise ValueError(f"router addresses {target!r} mix IPv4 and IPv6; give routers of one family")
    return f"{families.pop()}:{','.join(address for _, address in resolved)}"


def balancing_options(target: str) -> list[tuple[str, object]]:
    """Channel options for several routers (none for one): round robin, retries on UNAVAILABLE."""
    if len(split_targets(target)) == 1:
        return []
    config = {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [{
            "name": [{"service": GENERATION_SERVICE}],
            "retryPolicy": {"maxAttempts": RETRY_ATTEMPTS, "initialBackoff": "0.05s", "maxBackoff": "0.5s",
                            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
        }],
    }
    return [("grpc.service_config", json.dumps(config)), ("grpc.enable_retries", 1)]


def _resolved(item: str) -> tuple[str, str]:
    host, _, port = item.rpartition(":")
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        if not infos:
            raise ValueError(f"router host {host!r} does not resolve") from None
        ip = ipaddress.ip_address(infos[0][4][0])
    if ip.version == 6:
        return "ipv6", f"[{ip}]:{port}"
    return "ipv4", f"{ip}:{port}"

