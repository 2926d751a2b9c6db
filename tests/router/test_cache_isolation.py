"""--cache-isolation token: one tenant cannot probe another's prompts through cached_tokens.

A router with two API tokens, a prefill and a decode worker (tiny model, real gRPC). Tenant A
asks a prompt twice; then tenant B asks the same prompt. Under `token` B gets no prefix hit (its
blocks hash under its own salt), so cached_tokens tells B nothing about A; under `none` B's
request is served from A's cache, which is the probe the isolation closes.
"""

from __future__ import annotations

import grpc
import pytest

from pdserve.client import PdserveClient
from pdserve.engine.sequence import SamplingParams
from pdserve.security import SecurityConfig
from pdserve.worker.server import WorkerConfig
from router.server import RouterConfig, RouterServer
from tests.helpers.cluster import running_cluster
from tests.helpers.rig import reference_tokens
from tests.helpers.workers import WorkerStubs, wait_until_clean

TOKENS = ("tenant-a-token", "tenant-b-token")
PROMPT = [(11 * j) % 700 + 50 for j in range(80)]  # 5 full blocks: 4 can be a prefix hit
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


WORKERS = (WorkerConfig("prefill", metrics_port=None), WorkerConfig("decode", metrics_port=None))


def ask(router: RouterServer, token: str):
    with PdserveClient(router.address, metadata=(("authorization", f"Bearer {token}"),)) as client:
        return client.generate(token_ids=PROMPT, temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True)


@pytest.mark.parametrize("isolation, b_cached", [("token", 0), ("none", 64)])
def test_a_tenant_sees_no_prefix_hit_on_another_tenants_prompt(tiny_loaded, isolation, b_cached):
    with running_cluster(tiny_loaded, workers=WORKERS, security=SecurityConfig(api_tokens=TOKENS),
                         cache_isolation=isolation) as cluster:
        a_first, a_again = ask(cluster.router, TOKENS[0]), ask(cluster.router, TOKENS[0])
        b = ask(cluster.router, TOKENS[1])
        assert a_first.usage["cached_tokens"] == 0 and a_again.usage["cached_tokens"] == 64
        assert b.usage["cached_tokens"] == b_cached
        expected = reference_tokens(tiny_loaded, PROMPT, GREEDY)
        assert a_first.token_ids == a_again.token_ids == b.token_ids == expected
        wait_until_clean(*cluster.workers)


def test_token_isolation_needs_api_tokens(tiny_loaded):
    config = RouterConfig(port=0, metrics_port=None, cache_isolation="token")
    with pytest.raises(ValueError, match="needs API tokens"):
        RouterServer(config, tiny_loaded.tokenizer, lambda: [])
    with pytest.raises(ValueError, match="cache_isolation must be one of none, token"):
        RouterConfig(cache_isolation="tenant")


def test_a_decode_call_must_carry_the_cache_salt_its_kv_was_sent_under(tiny_loaded):
    """The decode worker checks the resume against the parked KV's salt too (trust nothing)."""
    from pdserve.worker.convert import sampling_to_proto
    from protos.pdserve.v1 import worker_pb2

    with running_cluster(tiny_loaded, workers=WORKERS) as cluster:
        prefill, decode = cluster.prefill, cluster.decode
        stub = lambda w: WorkerStubs(grpc.insecure_channel(w.address))  # noqa: E731
        reply = stub(prefill).Prefill(worker_pb2.PrefillRequest(
            request_id="salted", prompt_token_ids=PROMPT, sampling=sampling_to_proto(GREEDY),
            decode_target=decode.address, cache_salt=b"tenant-a"), timeout=30)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub(decode).Decode(worker_pb2.DecodeRequest(
                request_id="salted", prompt_token_ids=PROMPT, sampling=sampling_to_proto(GREEDY),
                first_token=reply.first_token, cache_salt=b"tenant-b"),
                timeout=30))
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "cache_salt" in refused.value.details()
        wait_until_clean(prefill, decode)
