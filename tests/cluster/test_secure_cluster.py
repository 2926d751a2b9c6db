"""A real cluster (Ray actors, embedded Redis) started with TLS, an API token and a cluster secret,
as `pdserve up --tls-cert --tls-key --tls-ca --api-token-file --cluster-secret-file` starts it."""

from __future__ import annotations

import uuid

import grpc
import pytest

from deploy.launcher import ClusterSpec, LocalCluster
from pdserve.client import PdserveClient, PdserveError
from pdserve.client_security import client_kwargs
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.security import CLUSTER_SECRET_KEY, TLSFiles, open_channel
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.config import PlacementConfig

TOKEN, SECRET = "cluster-test-token-1", "cluster-test-secret-2"


@pytest.mark.slow
def test_a_secured_cluster_serves_token_holders_and_members_only(ray_session, dev_certs, tmp_path):
    certs = dev_certs
    (tmp_path / "tokens.txt").write_text(f"# accepted API tokens\n{TOKEN}\n")
    (tmp_path / "secret.txt").write_text(f"{SECRET}\n")
    spec = ClusterSpec(num_prefill=1, num_decode=1, port=0, namespace=f"t{uuid.uuid4().hex[:6]}",
                       engine=EngineConfig(cache=CacheConfig(num_blocks=96)),
                       placement=PlacementConfig(routing="least_load"),
                       tls=TLSFiles(cert=certs.server_cert, key=certs.server_key, ca=certs.ca),
                       api_token_file=str(tmp_path / "tokens.txt"),
                       cluster_secret_file=str(tmp_path / "secret.txt"))
    said: list[str] = []
    cluster = LocalCluster(spec, say=said.append)
    cluster.start()
    try:
        assert "security TLS on · 1 API token · cluster secret on" in said
        assert [line for line in said if line.startswith("kernels  linear ")]  # what the first worker runs
        user = cluster.client_security()
        with PdserveClient(cluster.router.address, timeout_s=300, **client_kwargs(user)) as client:
            done = client.generate(token_ids=list(range(300, 360)), temperature=0, max_tokens=4,
                                   ignore_eos=True)
        assert done.prefill_worker == "prefill-0" and len(done.token_ids) == 4  # KV pushed over TLS

        tls_only = user.channel_credentials()
        with PdserveClient(cluster.router.address, timeout_s=60, credentials=tls_only) as anon:
            with pytest.raises(PdserveError) as error:
                anon.generate(token_ids=[1, 2, 3], max_tokens=1)
        assert error.value.code == "UNAUTHENTICATED"

        decode = next(w for w in cluster.registry.live_workers() if w.role == "decode")
        channel = open_channel(decode.address, user.tls)
        stub = worker_pb2_grpc.WorkerStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Status(worker_pb2.StatusRequest(), timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        status = stub.Status(worker_pb2.StatusRequest(), timeout=10, metadata=((CLUSTER_SECRET_KEY, SECRET),))
        assert status.transfer_outcomes["done"] == 1
        channel.close()
    finally:
        cluster.stop()
