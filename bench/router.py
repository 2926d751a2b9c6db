"""The router: what one prefix-routing decision costs, and what prefix routing buys a chat workload.

    python -m bench.router [--json] [--quick] [--reps N] [--only decision|chat]

Two parts, one run:

  decision  Placer.place(prompt_ids) end to end for 4,096-token prompts (256 blocks): block
            hashing, the prefix match on the router's mirror of the index (IndexMirror.match, in
            memory, wired as router/redis_backend.py wires it for `pdserve up`), scoring.
            Tokenising is excluded (the prompt goes in as token ids). The index lives in a real
            embedded redis-server; the mirror reads it and follows its feed. 16 workers (8 prefill
            + 8 decode) with live leases, in a WorkerDirectory fed static records; the index holds,
            for each worker, a different mix of prefixes of 8 long prompts, plus unrelated prompts.
            While the decisions are timed, a publisher process keeps writing to the index (stores
            and removals of unrelated blocks, FEED_EVENTS_PER_S), so the mirror's feed thread works
            beside the decisions as it does in a cluster. Each query shares a prefix of
            256..4,096 tokens with one long prompt and continues with fresh tokens. Reported:
            decision_p50_ms / decision_p99_ms, and p50 of each piece timed on its own with the same
            inputs (hash_blocks, IndexMirror.match, scoring.choose), and for comparison the one
            Redis round trip the router made before the mirror (RedisPrefixIndex.match,
            MATCH_LUA). The router's Redis clients are configured as in deploy/launcher.py (0.25 s
            timeouts, no retry; the mirror's own client as RouterRedis.connect makes it); a
            decision that fell back (the circuit breaker saw an error), or a mirror that disagrees
            with Redis's match once caught up, fails the run.
  chat      A multi-turn chat workload on a 2P+2D LocalCluster (SmolLM2), prefix routing against
            round_robin in the same run, each on a fresh cluster (fresh workers and Redis, so
            neither sees the other's cache) under one Ray instance. C conversations x T turns,
            one shared system prompt of ~300 tokens, greedy replies of R tokens; round k issues
            turn k of every conversation in a seeded shuffled order (the same for both policies),
            one request at a time. Reported per policy: mean TTFT (router-side, the Completion's
            timings.ttft_ms: request received -> first token out of the decode worker; the
            client-side figure is reported next to it), and the prefix hit rate
            (sum cached_tokens / sum prompt_tokens). Headlines:
              ttft_ratio_vs_round_robin = mean TTFT prefix / mean TTFT round_robin
              hit_rate_vs_ideal = prefix hit rate / ideal hit rate, where the ideal credits each
                request with the longest prefix, in whole blocks and never its last token, that
                it shares with any earlier request of the workload: its prompt and the reply
                tokens that have KV (all but the last sampled one; decode workers cache them),
                computed from the token ids (prompts templated here exactly as the router does).
            With --reps N > 1 the policy that goes first alternates, and figures are medians of
            the per-rep values.

Why the shuffle: with C a multiple of 2 and turns issued c0, c1, ..., round_robin over 2 decode
workers would send every turn of a conversation back to the same worker by arithmetic alone.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bench import common
from loadtest.stats import percentile
from pdserve.engine.hashing import PromptHashes, engine_salt, hash_blocks
from pdserve.index.base import WorkerKey
from pdserve.index.redis_index import RedisPrefixIndex
from pdserve.index.registry import WorkerInfo
from router.config import PlacementConfig
from router.placement import Placer
from router.scoring import ScoringWeights, choose
from router.workers import WorkerDirectory

TARGETS = {"decision_p50_ms": 0.5, "decision_p99_ms": 2.0, "ttft_ratio_vs_round_robin": 0.5,
           "hit_rate_vs_ideal": 0.9}
FEED_EVENTS_PER_S = 200  # index writes while decisions are timed: 16 workers' publishers, roughly
BLOCK_SIZE = 16
KV_DTYPE = "float32"
VOCAB = 49152
POLICIES = ("prefix", "round_robin")


@dataclass(frozen=True)
class Sizes:
    """FULL gives the documented keys; QUICK is a smoke run."""

    decisions: int = 2000
    prompt_tokens: int = 4096
    long_prompts: int = 8
    conversations: int = 8
    turns: int = 4
    reply_tokens: int = 32
    num_blocks: int = 1024  # per worker: the whole workload fits, nothing is evicted
    reps: int = 2


FULL = Sizes()
QUICK = Sizes(decisions=300, conversations=4, turns=3, reply_tokens=8, num_blocks=512, reps=1)


# === part 1: the decision ======================================================================


def populate_index(index: RedisPrefixIndex, workers: Sequence[WorkerKey], salt: bytes, sizes: Sizes,
                   rng: random.Random) -> list[list[int]]:
    """Live leases for every worker and a mix of prefixes of long prompts; returns the long prompts."""
    tokens = lambda: [rng.randrange(VOCAB) for _ in range(sizes.prompt_tokens)]
    for w in workers:
        index.set_live(w, ttl_s=3600.0)
    for _ in range(4 * sizes.long_prompts):  # unrelated prompts, so the sets are not alone in the store
        hashes = hash_blocks(tokens(), BLOCK_SIZE, salt)
        for w in rng.sample(list(workers), 4):
            index.apply(w, hashes[:rng.randint(1, len(hashes))], [])
    long_prompts = [tokens() for _ in range(sizes.long_prompts)]
    for w in workers:
        for prompt in long_prompts:
            if rng.random() < 0.75:  # each worker holds a prefix of most long prompts, each of its own depth
                hashes = hash_blocks(prompt, BLOCK_SIZE, salt)
                index.apply(w, hashes[:rng.randint(1, len(hashes))], [])
    return long_prompts


def queries(long_prompts: list[list[int]], count: int, rng: random.Random) -> list[list[int]]:
    """Each: a prefix of 16..256 blocks of a long prompt, then fresh tokens up to the same length."""
    out = []
    for i in range(count):
        base = long_prompts[i % len(long_prompts)]
        shared = BLOCK_SIZE * rng.randint(16, len(base) // BLOCK_SIZE)
        out.append(base[:shared] + [rng.randrange(VOCAB) for _ in range(len(base) - shared)])
    return out


def bench_decision(sizes: Sizes) -> dict[str, Any]:
    import redis

    from deploy.redis_server import RedisServer
    from router.redis_backend import RouterRedis

    rng = random.Random(0)
    fingerprint, namespace = "bench-router-model", "bench-router"
    placement = PlacementConfig(routing="prefix")
    salt = engine_salt(fingerprint, BLOCK_SIZE, KV_DTYPE)
    roles = ["prefill"] * 8 + ["decode"] * 8
    records = [WorkerInfo(f"{role}-{i % 8}", role, f"127.0.0.1:{50100 + i}", "bench", fingerprint, BLOCK_SIZE,
                          KV_DTYPE, salt.hex(), 1456, 1)
               for i, role in enumerate(roles)]
    server = RedisServer()
    url = server.start()
    try:
        writer = RedisPrefixIndex(redis.Redis.from_url(url), namespace)
        common.progress(f"decision: populating the index (16 workers, {sizes.long_prompts} long prompts)")
        workers = [WorkerKey(r.worker_id, r.epoch) for r in records]
        long_prompts = populate_index(writer, workers, salt, sizes, rng)
        backend = RouterRedis.connect(url, namespace)  # as redis_router builds the router's
        backend.mirror.start()
        directory = WorkerDirectory(lambda: records)
        directory.refresh()  # static records: the background refresh thread is not started
        placer = Placer(directory, placement, backend.mirror.match, rng=random.Random(0))
        prompts = queries(long_prompts, sizes.decisions, rng)
        try:
            with FeedPublisher(url, namespace, workers, salt) as publisher:
                before = publisher.events
                result = _time_decisions(placer, directory, backend, prompts, salt)
                timed_events = publisher.events - before
            _check_mirror_agrees(backend, prompts[:200], salt)
        finally:
            backend.mirror.stop()
        return {**result, "feed_events_while_timed": timed_events,
                "mirror_snapshots": backend.mirror.snapshots}
    finally:
        server.stop()


class FeedPublisher:
    """Another process writing to the index while decisions are timed, as workers' publishers do
    (stores and removals of blocks no query shares), FEED_EVENTS_PER_S apply() calls a second.

    NOTE: a process, not a thread: the workers that feed a router's mirror are other processes, so
    their work may take a core from the router but never its GIL."""

    def __init__(self, url: str, namespace: str, workers: Sequence[WorkerKey], salt: bytes) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._events = context.Value("q", 0)
        self._process = context.Process(target=publish_unrelated_blocks, name="bench-feed", daemon=True,
                                        args=(url, namespace, list(workers), salt, self._stop, self._events))

    @property
    def events(self) -> int:
        return int(self._events.value)

    def __enter__(self) -> FeedPublisher:
        self._process.start()
        deadline = time.monotonic() + 60
        while self.events == 0:  # its imports and first writes are not part of what is timed
            if time.monotonic() > deadline or not self._process.is_alive():
                raise RuntimeError("the feed publisher process wrote nothing within 60 s")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._process.join(timeout=30)


def publish_unrelated_blocks(url: str, namespace: str, workers: list[WorkerKey], salt: bytes, stop: Any,
                             events: Any) -> None:
    import redis

    writer = RedisPrefixIndex(redis.Redis.from_url(url), namespace)
    rng = random.Random(3)
    while not stop.wait(1 / FEED_EVENTS_PER_S):
        tokens = [rng.randrange(VOCAB) for _ in range(8 * BLOCK_SIZE)]
        hashes = hash_blocks(tokens, BLOCK_SIZE, salt)
        w = rng.choice(workers)
        writer.apply(w, hashes[:4], [])
        writer.apply(w, hashes[4:], hashes[:2])
        events.value += 2


def _check_mirror_agrees(backend: Any, prompts: list[list[int]], salt: bytes) -> None:
    backend.mirror.sync()
    for prompt in prompts:
        hashes = hash_blocks(prompt, BLOCK_SIZE, salt)
        if backend.mirror.match(hashes) != backend.index.match(hashes):
            raise RuntimeError("the mirror's match differs from Redis's once caught up: the decisions timed "
                               "did not see the index")


def _time_decisions(placer: Placer, directory: WorkerDirectory, backend: Any,
                    prompts: list[list[int]], salt: bytes) -> dict[str, Any]:
    weights, rng = ScoringWeights(), random.Random(0)
    decode, prefill = directory.candidates("decode"), directory.candidates("prefill")
    for prompt in prompts[:50]:  # warm-up: script load, connections, caches
        placer.place(prompt)
    common.progress(f"decision: timing {len(prompts):,} decisions on {len(prompts[0]):,}-token prompts")
    times: dict[str, list[float]] = {"place": [], "hash": [], "match": [], "score": [], "redis_match": []}
    depths, hashed = [], []
    for prompt in prompts:
        start = time.perf_counter()
        placer.place(prompt)
        times["place"].append(time.perf_counter() - start)
        start = time.perf_counter()
        hashes = hash_blocks(prompt, BLOCK_SIZE, salt)
        times["hash"].append(time.perf_counter() - start)
        start = time.perf_counter()
        held = backend.mirror.match(hashes)
        times["match"].append(time.perf_counter() - start)
        start = time.perf_counter()
        choose(len(prompt), BLOCK_SIZE, decode, prefill, held, weights, rng)
        times["score"].append(time.perf_counter() - start)
        start = time.perf_counter()
        backend.index.match(hashes)
        times["redis_match"].append(time.perf_counter() - start)
        depths.append(held)
        lazy = PromptHashes(prompt, BLOCK_SIZE, salt)  # untimed: how many blocks a decision hashes
        backend.mirror.match(lazy)
        hashed.append(lazy.computed)
    if placer.breaker.failures:
        raise RuntimeError(f"{placer.breaker.failures} index lookups failed and fell back to load-only "
                           "routing: those decisions are not what this benchmark names")
    ms = {k: [t * 1e3 for t in v] for k, v in times.items()}
    return {
        "decision_p50_ms": common.median(ms["place"]), "decision_p99_ms": percentile(ms["place"], 99),
        "decision_mean_ms": sum(ms["place"]) / len(ms["place"]),
        "hash_p50_ms": common.median(ms["hash"]), "match_p50_ms": common.median(ms["match"]),
        "match_p99_ms": percentile(ms["match"], 99), "score_p50_ms": common.median(ms["score"]),
        "redis_match_p50_ms": common.median(ms["redis_match"]),
        "redis_match_p99_ms": percentile(ms["redis_match"], 99),
        "decisions": len(prompts), "decision_workers": 16,
        "matched_workers_mean": sum(len(d) for d in depths) / len(depths),
        "matched_depth_blocks_mean": common.ratio(sum(sum(d.values()) for d in depths),
                                                  sum(len(d) for d in depths)),
        # the placer's lazy hashing (hashing.PromptHashes) stops with the match: of the prompt's blocks
        "hashed_blocks_mean": sum(hashed) / len(hashed), "prompt_blocks": len(prompts[0]) // BLOCK_SIZE,
    }


# === part 2: the chat workload ==================================================================

SYSTEM_PROMPT = (
    "You are Harbor, the reference assistant of the public library of a small coastal town. "
    "You answer questions from visitors of every age, from schoolchildren working on a project to "
    "retired sailors checking a detail of local history. Follow these rules in every answer. "
    "First, be accurate: when you are not sure of a fact, say so plainly and suggest where in the "
    "library the visitor could check it, such as the reference desk, the local history room on the "
    "second floor, the periodicals archive or the online catalogue. Second, be brief: start with a "
    "direct answer in one or two sentences, then add detail only when it helps. Third, be kind and "
    "patient, and never make a visitor feel that a question is too simple. Fourth, keep to plain "
    "language and explain any technical word the first time you use it. Fifth, when a question "
    "touches on health, law or money, give general background only and recommend a qualified "
    "professional. Sixth, respect privacy: never ask for personal details and never repeat any that "
    "a visitor shares. The library is open from nine in the morning to seven in the evening on "
    "weekdays and from ten to four on Saturdays; it is closed on Sundays and public holidays. Visitors "
    "may borrow up to twelve items for three weeks, renew them twice online or at the desk, and "
    "reserve items that are out on loan. The building has a children's corner, a quiet reading room, "
    "four meeting rooms that can be booked a week ahead, public computers and free wireless access."
)
TOPICS = ["the history of lighthouses", "how tides work", "the life cycle of a honeybee",
          "why the sky is blue", "how bread rises", "the first transatlantic telegraph cable",
          "how a compass finds north", "the migration of arctic terns", "how paper is made",
          "the rules of chess"]
TURNS = ["Can you tell me about {topic}?",
         "What are three facts about {topic} that most people do not know?",
         "How would you explain {topic} to a ten-year-old?",
         "Which books in the library should I read next to learn more about {topic}?",
         "Please summarise what we discussed about {topic} in two sentences."]


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_ids: list[int]
    reply_ids: list[int]
    usage: dict[str, int]
    ttft_ms: float  # router-side: Completion.timings["ttft_ms"]
    client_ttft_ms: float  # here: call -> first message carrying a token
    decode_worker: str
    prefill_worker: str | None


@dataclass
class PolicyRun:
    policy: str
    turns: list[Turn] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        prompt = sum(t.usage["prompt_tokens"] for t in self.turns)
        cached = sum(t.usage["cached_tokens"] for t in self.turns)
        ideal = ideal_cached_tokens([(t.prompt_ids, t.reply_ids) for t in self.turns], with_replies=True)
        ideal_prompts = ideal_cached_tokens([(t.prompt_ids, t.reply_ids) for t in self.turns],
                                            with_replies=False)
        by_turn: dict[int, list[float]] = {}
        for t in self.turns:
            by_turn.setdefault(t.turn, []).append(t.ttft_ms)
        return {
            "ttft_ms": _mean([t.ttft_ms for t in self.turns]),
            "client_ttft_ms": _mean([t.client_ttft_ms for t in self.turns]),
            "ttft_ms_by_turn": [_mean(by_turn[k]) for k in sorted(by_turn)],
            "hit_rate": cached / prompt,
            "ideal_hit_rate": sum(ideal) / prompt,
            "ideal_hit_rate_prompts_only": sum(ideal_prompts) / prompt,
            "hit_rate_vs_ideal": common.ratio(cached, sum(ideal)),
            "prompt_tokens": prompt, "cached_tokens": cached, "ideal_cached_tokens": sum(ideal),
            "requests": len(self.turns),
            "remote_prefills": sum(t.prefill_worker is not None for t in self.turns),
            "decode_workers": dict(Counter(t.decode_worker for t in self.turns)),
        }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def ideal_cached_tokens(requests: Sequence[tuple[list[int], list[int]]], with_replies: bool) -> list[int]:
    """Per request: the longest prefix, in whole blocks and never its last token, shared with an
    earlier request's tokens that have KV (its prompt, plus all but the last reply token)."""
    seen: list[list[int]] = []
    out = []
    for prompt, reply in requests:
        usable = (len(prompt) - 1) // BLOCK_SIZE
        best = max((_common_prefix(prompt, s) // BLOCK_SIZE for s in seen), default=0)
        out.append(min(best, usable) * BLOCK_SIZE)
        seen.append(prompt + reply[:-1] if with_replies else prompt)
    return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def chat_order(sizes: Sizes) -> list[tuple[int, int]]:
    """(conversation, turn) in issue order: round k is turn k of every conversation, shuffled."""
    rng = random.Random(1)
    order = []
    for k in range(sizes.turns):
        conversations = list(range(sizes.conversations))
        rng.shuffle(conversations)
        order += [(c, k) for c in conversations]
    return order


def run_chat(address: str, tokenizer: Any, sizes: Sizes, policy: str) -> PolicyRun:
    from pdserve.client import PdserveClient

    history = {c: [{"role": "system", "content": SYSTEM_PROMPT}] for c in range(sizes.conversations)}
    run = PolicyRun(policy)
    with PdserveClient(address, timeout_s=600.0) as client:
        for c, k in chat_order(sizes):
            messages = history[c]
            messages.append({"role": "user", "content": TURNS[k].format(topic=TOPICS[c])})
            prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            start = time.perf_counter()
            client_ttft = None
            with client.stream(messages=messages, temperature=0, max_tokens=sizes.reply_tokens) as stream:
                for response in stream:
                    if client_ttft is None and response.token_ids:
                        client_ttft = (time.perf_counter() - start) * 1e3
                completion = stream.result()
            if completion.usage["prompt_tokens"] != len(prompt_ids):
                raise RuntimeError(f"the router saw {completion.usage['prompt_tokens']} prompt tokens, the "
                                   f"template here gives {len(prompt_ids)}: the ideal would be computed "
                                   "from the wrong ids")
            messages.append({"role": "assistant", "content": completion.text})
            run.turns.append(Turn(c, k, prompt_ids, completion.token_ids, completion.usage,
                                  completion.timings["ttft_ms"], client_ttft or float("nan"),
                                  completion.decode_worker, completion.prefill_worker))
    return run


def warm_up(cluster: Any, address: str) -> None:
    """First-call costs on every worker and channel, outside the timed workload.

    Every prefill worker pushes one prompt to every decode worker (the P->D KV channels, each
    engine's first prefill), each decode worker prefills one itself, and two requests go through
    the router with round_robin (its channels to all four workers). The prompts are random ids,
    sharing no block with the workload.
    """
    import grpc

    from pdserve.client import request_from
    from pdserve.engine.sequence import SamplingParams
    from pdserve.grpc_options import message_options
    from pdserve.worker.convert import sampling_to_proto
    from protos.pdserve.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

    rng = random.Random(2)
    prompt = lambda: [rng.randrange(2000, VOCAB) for _ in range(300)]
    sampling = sampling_to_proto(SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    workers = cluster.router.directory.workers()
    channels = {w.address: grpc.insecure_channel(w.address, options=message_options()) for w in workers}
    prefill_stubs = {a: worker_pb2_grpc.PrefillServiceStub(c) for a, c in channels.items()}
    decode_stubs = {a: worker_pb2_grpc.DecodeServiceStub(c) for a, c in channels.items()}
    try:
        for d in (w for w in workers if w.role == "decode"):
            for p in (w for w in workers if w.role == "prefill"):
                ids, rid = prompt(), f"warm-{p.worker_id}-{d.worker_id}"
                reply = prefill_stubs[p.address].Prefill(worker_pb2.PrefillRequest(
                    request_id=rid, prompt_token_ids=ids, sampling=sampling, decode_target=d.address),
                    timeout=300)
                list(decode_stubs[d.address].Decode(worker_pb2.DecodeRequest(
                    request_id=rid, prompt_token_ids=ids, sampling=sampling, first_token=reply.first_token),
                    timeout=300))
            list(decode_stubs[d.address].Decode(worker_pb2.DecodeRequest(
                request_id=f"warm-{d.worker_id}", prompt_token_ids=prompt(), sampling=sampling,
                prefill_here=True), timeout=300))
        with grpc.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for _ in range(2):
                request = request_from(token_ids=prompt(), temperature=0, max_tokens=2, ignore_eos=True)
                request.routing = "round_robin"
                list(stub.Generate(request, timeout=300))
    finally:
        for channel in channels.values():
            channel.close()


def run_policy(policy: str, sizes: Sizes, tokenizer: Any) -> PolicyRun:
    from deploy.launcher import ClusterSpec, LocalCluster
    from pdserve.engine.config import CacheConfig, EngineConfig

    spec = ClusterSpec(num_prefill=2, num_decode=2, port=0, placement=PlacementConfig(routing=policy),
                       engine=EngineConfig(cache=CacheConfig(num_blocks=sizes.num_blocks)),
                       namespace=f"bench-router-{policy}")
    cluster = LocalCluster(spec, say=lambda line: common.progress(f"chat [{policy}] {line}"))
    address = cluster.start()
    try:
        common.progress(f"chat [{policy}]: warm-up")
        warm_up(cluster, address)
        n = sizes.conversations * sizes.turns
        common.progress(f"chat [{policy}]: {sizes.conversations} conversations x {sizes.turns} turns "
                        f"({n} requests)")
        return run_chat(address, tokenizer, sizes, policy)
    finally:
        names = list(cluster.actors)
        cluster.stop()
        _wait_until_names_free(names)


def _wait_until_names_free(names: Sequence[str], timeout_s: float = 60.0) -> None:
    """The next cluster reuses the actor names (prefill-0, ...): wait until Ray has let them go."""
    import ray

    deadline = time.monotonic() + timeout_s
    for name in names:
        while True:
            try:
                ray.get_actor(name)
            except ValueError:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray still knows actor {name!r} {timeout_s:.0f} s after it was killed")
            time.sleep(0.2)


def bench_chat(sizes: Sizes) -> dict[str, Any]:
    import ray

    from pdserve.engine.weights import load_tokenizer

    tokenizer = load_tokenizer(None)
    # NOTE: one Ray for both clusters, started as LocalCluster would start it (which then
    # neither starts nor stops it); 4 CPUs so its four 1-CPU actors fit on a 2-core machine.
    ray.init(num_cpus=max(os.cpu_count() or 1, 4), object_store_memory=256 << 20, namespace="bench-router",
             include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    try:
        per_policy: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
        for rep in range(sizes.reps):
            for policy in POLICIES if rep % 2 == 0 else POLICIES[::-1]:
                common.progress(f"chat: rep {rep + 1}/{sizes.reps}, policy {policy}")
                per_policy[policy].append(run_policy(policy, sizes, tokenizer).summary())
    finally:
        ray.shutdown()
    return _chat_result(per_policy)


def _chat_result(per_policy: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    med = lambda policy, key: common.median([s[key] for s in per_policy[policy]])
    prefix, rr = "prefix", "round_robin"
    return {
        "ttft_ratio_vs_round_robin": common.ratio(med(prefix, "ttft_ms"), med(rr, "ttft_ms")),
        "hit_rate_vs_ideal": med(prefix, "hit_rate_vs_ideal"),
        "ttft_ms_prefix": med(prefix, "ttft_ms"), "ttft_ms_round_robin": med(rr, "ttft_ms"),
        "client_ttft_ms_prefix": med(prefix, "client_ttft_ms"),
        "client_ttft_ms_round_robin": med(rr, "client_ttft_ms"),
        "client_ttft_ratio_vs_round_robin": common.ratio(med(prefix, "client_ttft_ms"),
                                                         med(rr, "client_ttft_ms")),
        "hit_rate_prefix": med(prefix, "hit_rate"), "hit_rate_round_robin": med(rr, "hit_rate"),
        "ideal_hit_rate": med(prefix, "ideal_hit_rate"),
        "ideal_hit_rate_prompts_only": med(prefix, "ideal_hit_rate_prompts_only"),
        "hit_rate_vs_ideal_round_robin": med(rr, "hit_rate_vs_ideal"),
        "chat_runs": per_policy,
    }


# === the run ====================================================================================


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = QUICK if args.quick else FULL
    if args.reps is not None:
        sizes = Sizes(**{**asdict(sizes), "reps": args.reps})
    load_at_start = common.warn_if_busy(1)
    result: dict[str, Any] = {}
    if args.only in (None, "decision"):
        result.update(bench_decision(sizes))
    if args.only in (None, "chat"):
        result.update(bench_chat(sizes))
    env = {**common.environment(1), "loadavg_at_start": load_at_start}
    return {**result, "targets": TARGETS, "quick": args.quick, "sizes": asdict(sizes), "environment": env}


def report(r: dict[str, Any]) -> str:
    met = lambda key, ok: "yes" if ok(r[key]) else "NO"
    lines = []
    if "decision_p50_ms" in r:
        head = (f"decision: Placer.place, {r['decisions']:,} prompts of 4,096 tokens, 16 workers, "
                f"{r['matched_workers_mean']:.1f} of them matched per prompt on average; "
                f"{r['hashed_blocks_mean']:.0f} of its {r['prompt_blocks']} blocks hashed per decision")
        p50, p99 = TARGETS["decision_p50_ms"], TARGETS["decision_p99_ms"]
        rows = [["decision p50", r["decision_p50_ms"], f"<= {p50}",
                 met("decision_p50_ms", lambda v: v <= p50)],
                ["decision p99", r["decision_p99_ms"], f"<= {p99}",
                 met("decision_p99_ms", lambda v: v <= p99)],
                ["  hash_blocks p50 (all blocks)", r["hash_p50_ms"], "", ""],
                ["  IndexMirror.match p50", r["match_p50_ms"], "", ""],
                ["  scoring.choose p50", r["score_p50_ms"], "", ""],
                ["(Redis MATCH_LUA p50, not in the decision)", r["redis_match_p50_ms"], "", ""]]
        lines += [head, common.format_table(["metric", "ms", "target", "met"], rows), ""]
    if "ttft_ratio_vs_round_robin" in r:
        lines += ["chat: prefix routing against round_robin; TTFT means over the workload's requests",
                  common.format_table(["metric", "prefix", "round_robin", "prefix / rr", "target", "met"], [
                      ["mean TTFT ms, router-side", r["ttft_ms_prefix"], r["ttft_ms_round_robin"],
                       r["ttft_ratio_vs_round_robin"], "<= 0.5",
                       met("ttft_ratio_vs_round_robin", lambda v: v <= 0.5)],
                      ["mean TTFT ms, client-side", r["client_ttft_ms_prefix"],
                       r["client_ttft_ms_round_robin"], r["client_ttft_ratio_vs_round_robin"], "", ""],
                      ["prefix hit rate", r["hit_rate_prefix"], r["hit_rate_round_robin"], "", "", ""],
                      [f"  / ideal {r['ideal_hit_rate']:.3f}", r["hit_rate_vs_ideal"],
                       r["hit_rate_vs_ideal_round_robin"], "", ">= 0.9",
                       met("hit_rate_vs_ideal", lambda v: v >= 0.9)]])]
        for policy, runs in r["chat_runs"].items():
            for i, s in enumerate(runs):
                lines.append(f"{policy} rep {i + 1}: {s['requests']} requests, {s['remote_prefills']} remote "
                             f"prefills, decode workers {s['decode_workers']}, mean TTFT by turn "
                             + ", ".join(f"{v:.0f}" for v in s["ttft_ms_by_turn"]) + " ms")
        lines.append("ideal hit rate counting prompts only (not reply KV): "
                     f"{r['ideal_hit_rate_prompts_only']:.3f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.bench_parser("python -m bench.router", __doc__)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 300 decisions; chat with 4 conversations x 3 turns of 8-token replies, "
                        "1 rep")
    p.add_argument("--reps", type=int, default=None,
                   help="reps of the chat workload per policy, each on fresh clusters "
                        "(default 2; 1 with --quick)")
    p.add_argument("--only", choices=["decision", "chat"], default=None,
                   help="run one part only (default: both)")
    return common.check_least(p, p.parse_args(argv), {"reps": 1})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    common.publish(report(result), result, args.json)


if __name__ == "__main__":
    main()
