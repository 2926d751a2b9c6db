"""The router and two workers secured as `pdserve up --tls-* --api-token-file --cluster-secret-file`
runs them: one process, real TLS sockets from a development CA, the tiny model.

    user --TLS + bearer token--> router --TLS + cluster secret--> prefill worker --TLS + secret--> decode
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.client import PdserveClient
from pdserve.client_security import client_kwargs
from pdserve.security import CLUSTER_SECRET_KEY, SecurityConfig, TLSConfig, open_channel
from pdserve.security.certs import DevCerts
from pdserve.worker.server import WorkerConfig, WorkerServer
from protos.pdserve.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    generation_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    worker_pb2,
)
from router.limits import RequestLimits
from router.server import RouterServer
from tests.helpers.cluster import Cluster, generate_request, running_cluster
from tests.helpers.workers import WorkerStubs, wait_until_clean

TOKEN, SECOND_TOKEN, SECRET = "api-token-alpha-1", "api-token-beta-2", "cluster-secret-gamma-3"
PROMPT = list(range(300, 350))  # 50 tokens >= min_remote_prefill_tokens: prefilled remotely, KV pushed
BEARER = "authorization"


@dataclass
class Secured:
    cluster: Cluster
    certs: DevCerts
    user: SecurityConfig  # what a client holding TOKEN dials with

    @property
    def router(self) -> RouterServer:
        return self.cluster.router

    @property
    def workers(self) -> list[WorkerServer]:
        return self.cluster.workers

    @property
    def prefill(self) -> WorkerServer:
        return self.cluster.prefill

    @property
    def decode(self) -> WorkerServer:
        return self.cluster.decode


@contextmanager
def secured_cluster(loaded, certs: DevCerts, mutual: bool = False) -> Iterator[Secured]:
    client_cert = (certs.client_cert, certs.client_key) if mutual else (None, None)
    workers_security = SecurityConfig(tls=certs.server_tls(require_client_cert=mutual),
                                      client_cert=client_cert[0], client_key=client_cert[1],
                                      cluster_secret=SECRET)
    workers = [WorkerConfig(role, metrics_port=None, security=workers_security)
               for role in ("prefill", "decode")]
    user = SecurityConfig(tls=TLSConfig(ca=certs.ca), client_cert=client_cert[0], client_key=client_cert[1],
                          api_tokens=(TOKEN,))
    with running_cluster(loaded, workers=workers, metrics_port=0,
                         security=replace(workers_security, api_tokens=(TOKEN, SECOND_TOKEN))) as cluster:
        yield Secured(cluster, certs, user)


@pytest.fixture(scope="module")
def secured(tiny_loaded, dev_certs) -> Iterator[Secured]:
    with secured_cluster(tiny_loaded, dev_certs) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def mutual(tiny_loaded, dev_certs) -> Iterator[Secured]:
    with secured_cluster(tiny_loaded, dev_certs, mutual=True) as cluster:
        yield cluster


def tls_channel(cluster: Secured, address: str) -> grpc.Channel:
    """TLS trusting the dev CA, and no credential at all: each call brings its own metadata."""
    return open_channel(address, TLSConfig(ca=cluster.certs.ca))


def worker_totals(cluster: Secured) -> list[tuple]:
    """What a request leaves behind on a worker: token totals, transfers, bytes, anything in flight."""
    out = []
    for s in (w.status() for w in cluster.workers):
        out.append((s.prompt_tokens_total, s.generated_tokens_total, s.active_requests, s.waiting_requests,
                    s.used_blocks, s.bytes_sent, s.bytes_received, dict(s.send_outcomes),
                    dict(s.transfer_outcomes)))
    return out


def refused(call) -> grpc.RpcError:
    """The error call() raises (a streaming call must be read inside call(): list(...))."""
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value


# --- the public API -------------------------------------------------------------------------------

def test_a_token_over_tls_gets_the_exact_tokens_of_a_plaintext_run(secured, tiny_loaded):
    with running_cluster(tiny_loaded, RequestLimits()) as plain:
        expected = [t for r in plain.stub.Generate(generate_request(PROMPT), timeout=60) for t in r.token_ids]
    before = secured.prefill.status().send_outcomes["done"], secured.decode.status().transfer_outcomes["done"]

    with PdserveClient(secured.router.address, timeout_s=60, **client_kwargs(secured.user)) as client:
        done = client.generate(token_ids=PROMPT, temperature=0, max_tokens=8, ignore_eos=True)

    assert done.token_ids == expected and len(expected) == 8
    # remote prefill: the KV crossed prefill -> decode over TLS, with the cluster secret
    assert done.prefill_worker == secured.prefill.config.worker_id
    after = secured.prefill.status().send_outcomes["done"], secured.decode.status().transfer_outcomes["done"]
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
    wait_until_clean(*secured.workers, timeout_s=10.0)


@pytest.mark.parametrize("metadata, why", [
    ((), "missing bearer token"),
    (((BEARER, "Bearer not-a-token"),), "invalid bearer token"),
    (((BEARER, f"Basic {TOKEN}"),), "malformed authorization"),
    (((BEARER, f"Bearer {SECRET}"),), "invalid bearer token"),  # the cluster secret is no API token
    (((CLUSTER_SECRET_KEY, SECRET),), "missing bearer token"),
])
def test_no_token_or_a_wrong_one_is_refused_before_any_worker_is_touched(secured, metadata, why):
    channel = tls_channel(secured, secured.router.address)
    before = worker_totals(secured)
    generation = generation_pb2_grpc.GenerationStub(channel)
    admin = admin_pb2_grpc.AdminStub(channel)

    request = generate_request(PROMPT)
    error = refused(lambda: list(generation.Generate(request, timeout=30, metadata=metadata)))
    assert error.code() is grpc.StatusCode.UNAUTHENTICATED and why in error.details()
    assert TOKEN not in error.details() and SECRET not in error.details()
    error = refused(lambda: admin.ClusterStatus(admin_pb2.ClusterStatusRequest(), timeout=30,
                                                metadata=metadata))
    assert error.code() is grpc.StatusCode.UNAUTHENTICATED

    assert worker_totals(secured) == before
    # the Generate handler never ran: it counts every call it serves, by status code
    samples = secured.router.metrics.registry.get_sample_value
    assert samples("pdserve_router_requests_total", {"code": "UNAUTHENTICATED"}) is None
    assert secured.router.servicer.requests_in_flight == 0
    channel.close()


def test_either_listed_token_is_accepted_and_admin_sees_the_workers_through_the_secret(secured):
    channel = tls_channel(secured, secured.router.address)
    admin = admin_pb2_grpc.AdminStub(channel)
    reply = admin.ClusterStatus(admin_pb2.ClusterStatusRequest(), timeout=30,
                                metadata=((BEARER, f"Bearer {SECOND_TOKEN}"),))
    states = [(w.status.role, w.state) for w in reply.workers]
    assert states == [("prefill", "serving"), ("decode", "serving")]
    channel.close()


def test_health_and_reflection_need_no_token(secured):
    channel = tls_channel(secured, secured.router.address)
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    (reply,) = reflection.ServerReflectionInfo(iter([ask]), timeout=10)
    assert "pdserve.v1.Generation" in {s.name for s in reply.list_services_response.service}
    channel.close()


def test_the_load_tester_finds_the_metrics_url_only_with_the_token(secured):
    from loadtest.server_metrics import discover_metrics_url

    url = f"http://{secured.router.metrics_address}/metrics"
    assert discover_metrics_url(secured.router.address, security=secured.user) == url
    tls_only = replace(secured.user, api_tokens=())
    assert discover_metrics_url(secured.router.address, security=tls_only) is None  # Admin refused


def test_a_plaintext_client_cannot_talk_to_a_tls_router(secured):
    with PdserveClient(secured.router.address, timeout_s=10,
                       metadata=secured.user.client_metadata(internal=False)) as client:
        with pytest.raises(Exception) as error:
            client.generate(token_ids=PROMPT, max_tokens=1)
    assert getattr(error.value, "code", None) == "UNAVAILABLE"


# --- the internal services -------------------------------------------------------------------------

@pytest.mark.parametrize("metadata, why", [
    ((), "missing cluster secret"),
    (((BEARER, f"Bearer {TOKEN}"),), "missing cluster secret"),  # a public token opens nothing inside
    (((CLUSTER_SECRET_KEY, TOKEN),), "wrong cluster secret"),
])
def test_workers_refuse_callers_without_the_cluster_secret(secured, metadata, why):
    before = worker_totals(secured)
    for worker in secured.workers:
        channel = tls_channel(secured, worker.address)
        calls = internal_calls(channel, worker.config.role, secured.decode.address, metadata)
        for name, call in calls.items():
            error = refused(call)
            assert (name, error.code()) == (name, grpc.StatusCode.UNAUTHENTICATED)
            assert why in error.details() and SECRET not in error.details()
        channel.close()
    assert worker_totals(secured) == before


def internal_calls(channel: grpc.Channel, role: str, decode_target: str,
                   metadata) -> dict[str, Callable[[], object]]:
    """Every method a worker of that role serves, called on channel with metadata."""
    stub, push = WorkerStubs(channel), kv_transfer_pb2_grpc.KVTransferStub(channel)
    prefill = worker_pb2.PrefillRequest(request_id="intruder", prompt_token_ids=PROMPT,
                                        decode_target=decode_target)
    decode = worker_pb2.DecodeRequest(request_id="intruder", prompt_token_ids=PROMPT, prefill_here=True)
    chunks = [kv_transfer_pb2.KVChunk(header=b"x")]
    shared = {
        "Status": lambda: stub.Status(worker_pb2.StatusRequest(), timeout=10, metadata=metadata),
        "Abort": lambda: stub.Abort(worker_pb2.AbortRequest(request_id="x"), timeout=10, metadata=metadata),
        "Audit": lambda: stub.Audit(worker_pb2.AuditRequest(), timeout=10, metadata=metadata),
    }
    if role == "prefill":
        return {**shared, "Prefill": lambda: stub.Prefill(prefill, timeout=10, metadata=metadata)}
    return {**shared, "Decode": lambda: list(stub.Decode(decode, timeout=10, metadata=metadata)),
            "Push": lambda: push.Push(iter(chunks), timeout=10, metadata=metadata)}


def test_the_cluster_secret_opens_a_worker_and_health_is_open(secured):
    channel = tls_channel(secured, secured.decode.address)
    status = WorkerStubs(channel).Status(worker_pb2.StatusRequest(), timeout=10,
                                                        metadata=((CLUSTER_SECRET_KEY, SECRET),))
    assert status.worker_id == secured.decode.config.worker_id
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()


# --- mutual TLS --------------------------------------------------------------------------------------

def test_mutual_tls_refuses_a_client_without_a_certificate(mutual):
    no_cert = replace(mutual.user, client_cert=None, client_key=None)
    with PdserveClient(mutual.router.address, timeout_s=10, **client_kwargs(no_cert)) as client:
        with pytest.raises(Exception) as error:
            client.generate(token_ids=PROMPT, max_tokens=1)
    assert getattr(error.value, "code", None) == "UNAVAILABLE"

    channel = open_channel(mutual.decode.address, TLSConfig(ca=mutual.certs.ca))  # no cert, the right secret
    with pytest.raises(grpc.RpcError) as refused_worker:
        WorkerStubs(channel).Status(worker_pb2.StatusRequest(), timeout=10,
                                                   metadata=((CLUSTER_SECRET_KEY, SECRET),))
    assert refused_worker.value.code() is grpc.StatusCode.UNAVAILABLE
    channel.close()


def test_mutual_tls_with_a_certificate_and_a_token_prefills_remotely(mutual):
    with PdserveClient(mutual.router.address, timeout_s=60, **client_kwargs(mutual.user)) as client:
        done = client.generate(token_ids=PROMPT, temperature=0, max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4 and done.prefill_worker == mutual.prefill.config.worker_id
    assert mutual.decode.status().transfer_outcomes["done"] >= 1


# --- the command line ---------------------------------------------------------------------------------

@pytest.fixture
def token_file(tmp_path) -> str:
    path = tmp_path / "token.txt"
    path.write_text(f"# the client's token\n{TOKEN}\n")
    return str(path)


def test_pdserve_status_and_generate_with_tls_ca_and_a_token_file(secured, token_file, capsys):
    from deploy.cli import main

    address, ca = secured.router.address, secured.certs.ca
    assert main(["status", "--router", address, "--tls-ca", ca, "--api-token-file", token_file]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()[2:] if not line.startswith("kernels on ")]
    assert sorted(row.split()[3] for row in rows) == ["serving", "serving"]

    assert main(["generate", "--router", address, "--tls-ca", ca, "--api-token-file", token_file,
                 "--token-ids", ",".join(map(str, PROMPT)), "--temperature", "0", "--max-tokens", "3",
                 "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3


def test_pdserve_clients_without_the_token_are_told_what_is_missing(secured, monkeypatch, capsys):
    from deploy.cli import main

    address, ca = secured.router.address, secured.certs.ca
    assert main(["status", "--router", address, "--tls-ca", ca]) == 1
    err = capsys.readouterr().err
    assert err.startswith("UNAUTHENTICATED: cannot read the cluster status") and "--api-token-file" in err
    assert main(["generate", "--router", address, "--tls-ca", ca, "--token-ids", "1,2"]) == 1
    assert capsys.readouterr().err.startswith("UNAUTHENTICATED: missing bearer token")

    monkeypatch.setenv("PDSERVE_TEST_TOKEN", "wrong-token")
    assert main(["generate", "--router", address, "--tls-ca", ca, "--api-token-env", "PDSERVE_TEST_TOKEN",
                 "--token-ids", "1,2"]) == 1
    assert capsys.readouterr().err.startswith("UNAUTHENTICATED: invalid bearer token")


def test_pdserve_generate_and_loadtest_under_mutual_tls(mutual, token_file, capsys):
    from deploy.cli import main

    c = mutual.certs
    flags = ["--router", mutual.router.address, "--tls-ca", c.ca, "--tls-client-cert", c.client_cert,
             "--tls-client-key", c.client_key, "--api-token-file", token_file]
    assert main(["generate", *flags, "--token-ids", "5,6,7", "--temperature", "0", "--max-tokens", "2",
                 "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 2

    assert main(["loadtest", *flags, "--requests", "2", "--concurrency", "1", "-p", "input_tokens=8",
                 "-p", "output_tokens=2", "-p", "token_ids=true", "--no-progress", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["counts"]["completed"] == 2 and report["errors"] == {}
    # the metrics URL came from Admin ClusterStatus, over mutual TLS with the token
    assert report["server_metrics"]["pdserve_router_requests_total"] == {"OK": 2}
