"""bench.disagg's two clusters (make bench runs it): each topology's spec is `pdserve up`'s, least-load
routed, with the short-prompt threshold and the pool the flags and the bench give it."""

from __future__ import annotations

import pytest

from bench.disagg import TOPOLOGIES, cluster_spec, parse_args


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_each_topology_gets_its_workers_least_load_routing_and_the_short_prompt_threshold(name):
    spec = cluster_spec(parse_args(["--min-remote-prefill-tokens", "96"]), name)
    assert (spec.num_prefill, spec.num_decode) == TOPOLOGIES[name]
    assert spec.placement.routing == "least_load"
    assert spec.placement.min_remote_prefill_tokens == 96
    assert spec.engine.cache.num_blocks == 1024
    assert spec.namespace == f"disagg-{name}"
