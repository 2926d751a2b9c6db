"""Several routers behind one client (pdserve/router_targets.py): the target and options (pure), and real
routers over the tiny cluster: calls spread over both, and a router that answers UNAVAILABLE before the
first token (it sees no decode worker) is retried on the other, so every call succeeds."""

from __future__ import annotations

import json

import pytest

from pdserve.client import PdserveClient
from pdserve.router_targets import balancing_options, channel_target, split_targets
from tests.helpers.cluster import running_cluster, start_router
from tests.helpers.workers import wait_until_clean


def test_one_router_is_dialled_as_given_and_several_as_one_balanced_channel():
    assert channel_target("localhost:50051") == "localhost:50051" and balancing_options("a:1") == []
    assert channel_target("127.0.0.1:1, localhost:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert channel_target("[::1]:1,[::1]:2") == "ipv6:[::1]:1,[::1]:2"
    options = dict(balancing_options("127.0.0.1:1,127.0.0.1:2"))
    config = json.loads(options["grpc.service_config"])
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["methodConfig"][0]["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]


@pytest.mark.parametrize("target", ["", "a:1,,b:2", "nocolon", "a:port"])
def test_a_malformed_address_is_named(target):
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_targets(target)


def requests_ok(router) -> float:
    return router.metrics.registry.get_sample_value("pdserve_router_requests_total", {"code": "OK"}) or 0.0


def test_calls_spread_over_two_routers_and_a_refusing_one_is_retried_on_the_other(tiny_loaded):
    prompt = list(range(300, 340))
    with running_cluster(tiny_loaded) as cluster:
        second = start_router(tiny_loaded, cluster.records)
        blind = start_router(tiny_loaded, [])  # no worker: every call UNAVAILABLE, before any token
        try:
            both = f"{cluster.router.address},{second.address}"
            with PdserveClient(both, timeout_s=30) as client:
                answers = [client.generate(token_ids=prompt, temperature=0, max_tokens=4) for _ in range(6)]
            assert len({tuple(a.token_ids) for a in answers}) == 1
            assert requests_ok(cluster.router) >= 1 and requests_ok(second) >= 1
            with PdserveClient(f"{blind.address},{second.address}", timeout_s=30) as client:
                for _ in range(4):
                    assert client.generate(token_ids=prompt, temperature=0, max_tokens=4).token_ids == \
                        answers[0].token_ids
            unavailable = blind.metrics.registry.get_sample_value("pdserve_router_requests_total",
                                                                  {"code": "UNAVAILABLE"})
            assert unavailable >= 1  # some calls went there first, and were retried on the other
            wait_until_clean(*cluster.workers)
        finally:
            second.stop()
            blind.stop()
