"""Prometheus endpoints and the Admin ClusterStatus call, on a router + two real workers
in one process over real gRPC sockets (tiny model)."""

from __future__ import annotations

import grpc
import pytest

from pdserve.metrics import scrape
from protos.pdserve.v1 import admin_pb2, admin_pb2_grpc, generation_pb2_grpc
from tests.helpers.cluster import generate, generate_request, metric_value, running_cluster
from tests.helpers.waiting import wait_for
from tests.helpers.workers import wait_until_clean


@pytest.fixture()
def cluster(tiny_loaded):
    with running_cluster(tiny_loaded, metrics_port=0) as c:
        yield c.router, c.workers


MAX_TOKENS = 6


def test_router_counters_match_what_clients_saw(cluster):
    router, workers = cluster
    prompt = list(range(300, 350))  # 50 tokens: prefilled remotely, 3 whole blocks
    replies = [generate(router, generate_request(prompt, MAX_TOKENS)) for _ in range(3)]
    with pytest.raises(grpc.RpcError) as bad:
        generate(router, generate_request([10**7], MAX_TOKENS))
    assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    m = scrape(f"http://{router.metrics_address}/metrics")
    assert metric_value(m, "pdserve_router_requests_total", code="OK") == 3
    assert metric_value(m, "pdserve_router_requests_total", code="INVALID_ARGUMENT") == 1
    streamed = sum(len(r.token_ids) for rs in replies for r in rs)
    assert metric_value(m, "pdserve_router_generated_tokens_total") == streamed == 18
    assert metric_value(m, "pdserve_router_prompt_tokens_total") == 150
    cached = sum(rs[-1].usage.cached_tokens for rs in replies)
    # turns 2 and 3 hit 3 blocks
    assert metric_value(m, "pdserve_router_cached_tokens_total") == cached == 2 * 48
    assert metric_value(m, "pdserve_router_ttft_seconds_count") == 3
    assert metric_value(m, "pdserve_router_itl_seconds_count") == 3 * 5
    assert metric_value(m, "pdserve_router_remote_prefills_total", outcome="ok") == 3
    assert metric_value(m, "pdserve_router_requests_in_flight") == 0
    assert metric_value(m, "pdserve_router_ended_early_total", code="INVALID_ARGUMENT", phase="received") == 1


def test_a_stream_the_client_cancels_is_counted_in_the_phase_it_stood_in(cluster):
    router, workers = cluster
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(router.address))
    call = stub.Generate(generate_request(list(range(300, 350)), 400), timeout=30)
    assert next(call).token_ids  # decoding: tokens are streaming back
    call.cancel()
    assert wait_for(lambda: router.metrics.registry.get_sample_value(
        "pdserve_router_ended_early_total", {"code": "CANCELLED", "phase": "decoding"}) == 1)
    wait_until_clean(*workers)


def test_worker_metrics_agree_with_status(cluster):
    router, workers = cluster
    prefill, decode = workers
    generate(router, generate_request(list(range(400, 450)), MAX_TOKENS))
    for worker in workers:
        status = worker.status()
        m = scrape(f"http://{status.metrics_address}/metrics")
        assert metric_value(m, "pdserve_worker_kv_blocks", state="total") == status.num_blocks == 128
        assert metric_value(m, "pdserve_worker_kv_blocks", state="used") == status.used_blocks == 0
        assert metric_value(m, "pdserve_worker_prompt_tokens_total") == status.prompt_tokens_total == 50
        assert metric_value(m, "pdserve_worker_requests_running") == 0
    d = scrape(f"http://{decode.status().metrics_address}/metrics")
    p = scrape(f"http://{prefill.status().metrics_address}/metrics")
    sent = metric_value(p, "pdserve_worker_kv_bytes_sent_total")
    assert metric_value(d, "pdserve_worker_kv_bytes_received_total") == sent > 0
    assert metric_value(d, "pdserve_worker_kv_transfers_received_total", outcome="done") == 1
    assert metric_value(p, "pdserve_worker_kv_transfers_sent_total", outcome="done") == 1
    assert metric_value(d, "pdserve_worker_kv_transfer_failures_total") == 0
    assert metric_value(d, "pdserve_worker_generated_tokens_total") == 6
    assert metric_value(d, "pdserve_worker_itl_seconds_count") == 5
    assert metric_value(p, "pdserve_worker_ttft_seconds_count") == 1


def test_cluster_status_lists_every_worker_and_marks_the_dead(cluster):
    router, workers = cluster
    generate(router, generate_request(list(range(500, 550)), MAX_TOKENS))
    admin = admin_pb2_grpc.AdminStub(grpc.insecure_channel(router.address))
    reply = admin.ClusterStatus(admin_pb2.ClusterStatusRequest(), timeout=10)
    assert reply.router_address == router.address and reply.metrics_address == router.metrics_address
    assert reply.routing_policy == "least_load" and reply.index_available
    roles_states = [(w.status.role, w.state) for w in reply.workers]
    assert roles_states == [("prefill", "serving"), ("decode", "serving")]
    assert reply.workers[1].status.generated_tokens_total == 6

    workers[0].stop()
    reply = admin.ClusterStatus(admin_pb2.ClusterStatusRequest(), timeout=10)
    assert [(w.status.worker_id, w.state) for w in reply.workers] == [
        (workers[0].config.worker_id, "unreachable"), (workers[1].config.worker_id, "serving")]


def test_pdserve_status_prints_one_row_per_worker(cluster, capsys):
    from deploy.cli import main

    router, workers = cluster
    generate(router, generate_request(list(range(600, 650)), MAX_TOKENS))
    generate(router, generate_request(list(range(600, 650)), MAX_TOKENS))
    assert main(["status", "--router", router.address]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"router {router.address} · metrics {router.metrics_address}")
    assert lines[1].split()[:4] == ["worker", "role", "node", "state"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    prefill = rows[workers[0].config.worker_id]
    assert prefill[1:2] + prefill[3:6] == ["prefill", "serving", "0/0", "0"]  # queue, load: idle
    assert prefill[8:10] == ["off", "off"]  # no host or disk tier
    assert prefill[10] == "48.0%"  # the second request hit 3 of its 50 tokens' blocks: 48 / 100 tokens
    assert main(["status", "--router", "127.0.0.1:1", "--timeout", "1"]) == 1
    assert "cannot read the cluster status from 127.0.0.1:1" in capsys.readouterr().err
