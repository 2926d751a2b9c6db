"""The cluster on local Ray + real Redis, SmolLM2, 1 prefill + 1 decode worker."""

from __future__ import annotations

import time

import pytest

from pdserve.client import PdserveError
from pdserve.engine.hashing import hash_blocks
from pdserve.engine.sequence import SamplingParams
from tests.conftest import make_engine
from tests.helpers.kv_audit import audit_failures
from tests.helpers.ray_cluster import client_of, wait_until_cluster_clean, worker_addresses, worker_status

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "hi",
]


@pytest.fixture(scope="module")
def reference(smollm_loaded):
    return make_engine(smollm_loaded)


def reference_tokens(reference, prompt_ids: list[int], max_tokens: int) -> list[int]:
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens)
    return reference.generate([prompt_ids], sampling, detokenize=False)[0].token_ids


def chat_ids(loaded, text: str) -> list[int]:
    return loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_greedy_output_matches_the_single_process_engine(cluster_1p1d, smollm_loaded, reference):
    with client_of(cluster_1p1d) as client:
        for text in PROMPTS:
            ids = chat_ids(smollm_loaded, text)
            done = client.generate(text, temperature=0, max_tokens=24, routing="least_load")
            assert done.token_ids == reference_tokens(reference, ids, 24), text
            assert done.text == smollm_loaded.tokenizer.decode(done.token_ids)
            remote = len(ids) >= cluster_1p1d.spec.placement.min_remote_prefill_tokens
            assert done.prefill_worker == ("prefill-0" if remote else None)
    wait_until_cluster_clean(cluster_1p1d)


def test_short_prompts_prefill_on_the_decode_worker(cluster_1p1d, reference):
    ids = [1, 2, 3, 4, 5]
    with client_of(cluster_1p1d) as client:
        done = client.generate(token_ids=ids, temperature=0, max_tokens=8)
    assert done.prefill_worker is None and done.decode_worker == "decode-0"
    assert done.token_ids == reference_tokens(reference, ids, 8)


def test_tokens_stream_incrementally(cluster_1p1d):
    arrivals = []
    with client_of(cluster_1p1d) as client:
        stream = client.stream("Count slowly from one to fifty.", temperature=0, max_tokens=64,
                               ignore_eos=True)
        for message in stream:
            arrivals.append((time.perf_counter(), len(message.token_ids)))
    assert sum(n for _, n in arrivals) == 64
    assert len(arrivals) >= 32  # token by token, not one final blob
    first, last = arrivals[0][0], arrivals[-1][0]
    assert last - first > 0.5 * (last - arrivals[0][0] + (first - first)), "all tokens arrived at once"
    assert (arrivals[1][0] - first) < (last - first) / 4


def test_second_turn_reuses_the_first_turn(cluster_1p1d, smollm_loaded):
    with client_of(cluster_1p1d) as client:
        turn1 = [{"role": "user", "content": "Give me a two-sentence story about a lighthouse."}]
        first = client.generate(messages=turn1, temperature=0, max_tokens=40)
        turn2 = turn1 + [{"role": "assistant", "content": first.text},
                         {"role": "user", "content": "Now give it a title."}]
        second = client.generate(messages=turn2, temperature=0, max_tokens=16)
    tok = smollm_loaded.tokenizer
    history = tok.apply_chat_template(turn1) + first.token_ids  # the first turn's prompt and reply
    turn2_ids = tok.apply_chat_template(turn2)
    assert turn2_ids[:len(history)] == history, "turn 2 repeats turn 1's prompt and reply verbatim"
    # NOTE: the reply's last token was sampled but never fed back, so its KV does not exist
    # anywhere: the cacheable history is one token shorter than prompt + reply.
    assert second.usage["cached_tokens"] >= 16 * ((len(history) - 1) // 16)
    assert second.decode_worker == first.decode_worker


def test_index_holds_the_prompt_blocks_until_the_workers_evict_them(cluster_1p1d, smollm_loaded):
    text = "Describe the water cycle for a ten-year-old, step by step, in detail."
    ids = chat_ids(smollm_loaded, text)
    with client_of(cluster_1p1d) as client:
        done = client.generate(text, temperature=0, max_tokens=4, routing="least_load")  # remote prefill
    workers = {w.worker_id: w for w in cluster_1p1d.registry.live_workers()}
    salt = _salt(smollm_loaded)
    hashes = set(hash_blocks(ids, 16, salt))
    assert hashes, "the prompt has full blocks"
    index = cluster_1p1d_index(cluster_1p1d)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        held = {w: hashes <= index.worker_hashes(w) for w in workers}
        if all(held.values()):
            break
        time.sleep(0.1)
    assert held == {"prefill-0": True, "decode-0": True}, held
    assert done.prefill_worker == "prefill-0"
    # 10 unrelated 160-token prompts need 100 blocks per worker; each pool holds 96: both evict
    with client_of(cluster_1p1d) as client:
        for i in range(10):
            filler = [1000 + 97 * i + j for j in range(160)]
            client.generate(token_ids=filler, temperature=0, max_tokens=1, routing="least_load")
    index = cluster_1p1d_index(cluster_1p1d)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(hashes & index.worker_hashes(w) for w in workers):
        time.sleep(0.1)
    assert {w: len(hashes & index.worker_hashes(w)) for w in workers} == {"prefill-0": 0, "decode-0": 0}
    wait_until_cluster_clean(cluster_1p1d)


def test_cancel_and_deadline_free_blocks_on_both_workers(cluster_1p1d):
    long_text = "Write a very long essay about the history of bridges. " * 8
    with client_of(cluster_1p1d) as client:
        stream = client.stream(long_text, temperature=0, max_tokens=400, ignore_eos=True)
        next(iter(stream))
        stream.cancel()
        wait_until_cluster_clean(cluster_1p1d, 10)  # the cancelled request left no block behind
        with pytest.raises(PdserveError) as err:
            client.generate(long_text, temperature=0, max_tokens=400, ignore_eos=True, timeout_s=1.5)
        assert err.value.code == "DEADLINE_EXCEEDED"
        wait_until_cluster_clean(cluster_1p1d, 10)  # the expired request left no block behind
    assert not audit_failures(worker_addresses(cluster_1p1d))


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens must be >= 1"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"prompt": "hi", "temperature": -1.0}, "temperature must be >= 0"),
    ({"token_ids": [1, 60000]}, "token id 60000 is outside the vocabulary"),
    ({"token_ids": list(range(9000))}, "prompt has 9,000 tokens"),
])
def test_bad_requests_get_invalid_argument_naming_the_field(cluster_1p1d, kwargs, message):
    with client_of(cluster_1p1d) as client:
        with pytest.raises(PdserveError) as err:
            client.generate(**kwargs)
    assert err.value.code == "INVALID_ARGUMENT" and message in err.value.message
    wait_until_cluster_clean(cluster_1p1d)


def _salt(loaded):
    from pdserve.engine.hashing import engine_salt

    return engine_salt(loaded.fingerprint, 16, "float32")


def cluster_1p1d_index(cluster):
    import redis

    from pdserve.index.redis_index import RedisPrefixIndex

    return RedisPrefixIndex(redis.Redis.from_url(cluster.redis_url), cluster.spec.namespace)


def test_pdserve_audit_checks_every_worker_of_the_cluster(cluster_1p1d, capsys):
    from deploy.cli import main

    code = main(["audit", "--router", cluster_1p1d.router.address])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:3]}
    assert set(rows) == {"prefill-0", "decode-0"}
    assert all(r[2] == "audited" and r[6] == "0" and int(r[4]) == int(r[3]) > 0 for r in rows.values()), out


def test_status_reports_both_workers(cluster_1p1d):
    status = worker_status(cluster_1p1d)
    assert set(status) == {"prefill-0", "decode-0"}
    assert {s.role for s in status.values()} == {"prefill", "decode"}


def test_worker_processes_run_with_the_worker_environment(cluster_1p1d):
    import ray

    for actor in cluster_1p1d.actors.values():
        pid = ray.get(actor.describe.remote(), timeout=60)["pid"]
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        assert environ[b"MALLOC_ARENA_MAX"] == b"2"
        assert environ[b"OMP_WAIT_POLICY"] == b"PASSIVE"
