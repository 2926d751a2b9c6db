"""A router names the Ray cluster and namespace it runs in (Admin ClusterStatus), and `pdserve down
--router` finds a detached cluster by it (deploy/detached.py ray_home_of): a router of a foreground
`pdserve up` names none, and down says how to stop that one instead."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deploy.detached import ray_home_of
from deploy.redis_server import free_port
from pdserve.security import SecurityConfig
from router.admin import NOT_IN_RAY, RayHome
from router.limits import RequestLimits
from router.server import RouterConfig, RouterServer
from tests.helpers.cluster import TINY_CONTEXT


@pytest.fixture()
def start(tiny_loaded):
    routers = []

    def start_router(ray_home: RayHome) -> str:
        limits = replace(RequestLimits(), max_context_tokens=TINY_CONTEXT)
        router = RouterServer(RouterConfig(port=0, limits=limits), tiny_loaded.tokenizer, lambda: [],
                              ray_home=ray_home)
        routers.append(router)
        return router.start()

    yield start_router
    for router in routers:
        router.stop()


def test_a_router_in_ray_names_its_cluster_and_namespace(start):
    address = start(RayHome("10.0.0.7:6379", "pdserve-a"))
    assert ray_home_of(address, SecurityConfig()) == ("10.0.0.7:6379", "pdserve-a")


def test_down_by_a_foreground_router_says_to_stop_it_where_it_runs(start):
    address = start(NOT_IN_RAY)
    with pytest.raises(ValueError, match=r"runs in a `pdserve up` process.*Ctrl-C"):
        ray_home_of(address, SecurityConfig())


def test_down_by_a_router_that_does_not_answer_asks_for_the_namespace():
    with pytest.raises(ValueError, match=r"does not answer; give the cluster as --namespace NAME --address"):
        ray_home_of(f"127.0.0.1:{free_port()}", SecurityConfig())
