"""`pdserve down`'s arguments: the cluster named by one router, or by its namespace and Ray address
(deploy/detached.py run_down); a wrong combination is a usage error that says what to give."""

from __future__ import annotations

import pytest

from deploy.cli import main


def test_namespace_without_an_address_asks_for_the_one_up_printed(capsys):
    assert main(["down", "--namespace", "pdserve"]) == 2
    assert "--namespace needs --address: the Ray address `pdserve up --detach`" in capsys.readouterr().err


def test_a_router_names_its_ray_cluster_itself(capsys):
    assert main(["down", "--router", "127.0.0.1:1", "--address", "auto"]) == 2
    assert "--address goes with --namespace" in capsys.readouterr().err


def test_down_needs_a_router_or_a_namespace(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["down"])
    assert exit_.value.code == 2
    assert "one of the arguments --router --namespace is required" in capsys.readouterr().err
