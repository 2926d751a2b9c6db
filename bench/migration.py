"""What a migration adds: the gap a client sees when its stream's decode worker is SIGKILLed mid-way.

    python -m bench.migration [--json] [--quick] [--reps N] [--streams N] [--new-tokens N] [--no-restart]

Cluster: LocalCluster (what `pdserve up` starts) with 1 prefill and 2 decode workers, SmolLM2,
its default (prefix) routing, which splits the streams between the two decode workers and
prefills a replay on the worker it moves to (that worker lacks fewer than 256 of its tokens).
Each rep opens --streams streams of --new-tokens tokens at once (greedy and seeded in turn,
ignore_eos), waits until every one has KILL_AFTER tokens, SIGKILLs the decode worker that holds
the most of them (the router's count), and reads every stream to its end; then it waits for Ray to
restart the worker before the next rep. The router continues each broken stream on the surviving
worker (router/service.py).

  gap        per migrated stream, at the client: the arrival of the first token after the kill
             minus that of the last token before it (so it includes the one inter-token interval
             the stream would have waited anyway)
  router gap the same at the router: Migration.gap_ms in the stream's last message
  peer       the same streams' ordinary inter-token gaps in the warm-up rep (no kill), this run

Ray restarts the killed worker at once, and on a small CPU machine its model load competes with the
replay for the cores; --no-restart (max_restarts 0, a fresh cluster per kill) measures without it.

Every rep's tokens are compared with the warm-up rep's (identical_tokens). Headlines: gap p50 and
p99 over each rep's migrated streams, median over reps, and their ratio to the peer's ITL p50.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from bench import common
from loadtest.stats import percentile

KILL_AFTER = 16  # tokens every stream has when its decode worker is killed
TOPICS = ["rivers", "owls", "bread", "trains", "glaciers", "violins", "lighthouses", "bees", "volcanoes",
          "chess", "tides", "maps"]


@dataclass(frozen=True)
class Sizes:
    reps: int = 3  # kills
    streams: int = 8
    new_tokens: int = 64


QUICK = Sizes(reps=1, streams=4, new_tokens=32)


@dataclass
class Stream:
    """One stream, read on a thread of its own: its tokens and when each message carrying some came."""

    call: Any
    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self) -> Any:
        for response in self.call:
            if response.token_ids:
                with self.lock:
                    self.tokens.extend(response.token_ids)
                    self.arrivals.extend([time.monotonic()] * len(response.token_ids))
        return self.call.result()

    def count(self) -> int:
        with self.lock:
            return len(self.tokens)

    def gap_across(self, at: float) -> float | None:
        """Seconds from the last token before `at` to the first after it; None without both."""
        before = [t for t in self.arrivals if t <= at]
        after = [t for t in self.arrivals if t > at]
        return after[0] - before[-1] if before and after else None


def sampling(i: int, new_tokens: int) -> dict[str, Any]:
    fields: dict[str, Any] = dict(max_tokens=new_tokens, ignore_eos=True, top_k=40, top_p=0.9)
    return fields | ({"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": 100 + i})


def prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me about {TOPICS[i % 12]} "
                                                                       f"in a few sentences ({i})."}])
            for i in range(n)]


def one_rep(cluster, client, ids: list[list[int]], sizes: Sizes, kill: bool) -> dict[str, Any]:
    """Run the streams; with kill, SIGKILL the busiest decode worker once every stream has KILL_AFTER
    tokens."""
    with cf.ThreadPoolExecutor(len(ids)) as pool:
        streams = [Stream(client.stream(token_ids=p, **sampling(i, sizes.new_tokens)))
                   for i, p in enumerate(ids)]
        ends = [pool.submit(s.read) for s in streams]
        killed_at, victim, epoch = None, None, 0
        if kill:
            while min(s.count() for s in streams) < KILL_AFTER:
                time.sleep(0.002)
            victim = busiest_decode(cluster)
            epoch, pid = epoch_of(cluster, victim), cluster_pid(cluster, victim)
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
        done = [e.result() for e in ends]
    moved = [(s, d) for s, d in zip(streams, done) if d.migrations]
    gaps = [s.gap_across(killed_at) for s, _ in moved] if killed_at is not None else []
    return {"tokens": [d.token_ids for d in done], "moved": len(moved), "victim": victim, "epoch": epoch,
            "gaps_s": [g for g in gaps if g is not None],
            "router_gaps_s": [d.migrations[0]["gap_ms"] / 1e3 for _, d in moved],
            "itl_s": [b - a for s in streams for a, b in zip(s.arrivals, s.arrivals[1:]) if b > a]}


def cluster_pid(cluster, worker_id: str) -> int:
    import ray
    return ray.get(cluster.actors[worker_id].describe.remote(), timeout=120)["pid"]


def wait_for_restart(cluster, worker_id: str, above_epoch: int, timeout_s: float = 300.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        live = {w.worker_id: w for w in cluster.registry.live_workers()}
        if worker_id in live and live[worker_id].epoch > above_epoch:
            cluster.router.directory.refresh()
            return live[worker_id].epoch
        time.sleep(0.2)
    raise TimeoutError(f"{worker_id} did not come back within {timeout_s} s")


def epoch_of(cluster, worker_id: str) -> int:
    return {w.worker_id: w.epoch for w in cluster.registry.live_workers()}[worker_id]


def busiest_decode(cluster) -> str:
    return max(("decode-0", "decode-1"), key=cluster.router.directory.in_flight)


@contextmanager
def running(spec) -> Iterator[tuple[Any, Any]]:
    """A started LocalCluster and a client of its router; both stopped on the way out."""
    from deploy.launcher import LocalCluster
    from pdserve.client import PdserveClient

    cluster = LocalCluster(spec, say=lambda line: common.progress(f"cluster: {line}"))
    try:
        cluster.start()
        with PdserveClient(cluster.router.address, timeout_s=600) as client:
            yield cluster, client
    finally:
        cluster.stop()


def run(args: Any) -> dict[str, Any]:
    from deploy.config import ClusterSpec

    base = QUICK if args.quick else Sizes()
    chosen = {k: getattr(args, k) for k in ("reps", "streams", "new_tokens")}
    sizes = replace(base, **{k: v for k, v in chosen.items() if v is not None})
    load_at_start = common.warn_if_busy(len(os.sched_getaffinity(0)))
    spec = ClusterSpec(num_prefill=1, num_decode=2, port=0, http_port=0, namespace="bench-migration",
                       max_restarts=0 if args.no_restart else -1)
    # --no-restart: a killed worker stays dead, so each kill needs a cluster of its own
    clusters, kills_each = (sizes.reps, 1) if args.no_restart else (1, sizes.reps)
    reference: dict[str, Any] | None = None
    reps: list[dict[str, Any]] = []
    for _ in range(clusters):
        with running(spec) as (cluster, client):
            ids = prompts(cluster.router.servicer.tokenizer, sizes.streams)
            if reference is None:
                common.progress("warm-up rep (no kill): the reference tokens and the peer's inter-token gaps")
                reference = one_rep(cluster, client, ids, sizes, kill=False)
            for _ in range(kills_each):
                common.progress(f"rep {len(reps) + 1}/{sizes.reps}: SIGKILL the busiest decode worker after "
                         f"{KILL_AFTER} tokens a stream")
                r = one_rep(cluster, client, ids, sizes, kill=True)
                r["identical_tokens"] = r.pop("tokens") == reference["tokens"]
                reps.append(r)
                common.progress(f"  {r['victim']}: {r['moved']} streams moved")
                if not args.no_restart:
                    wait_for_restart(cluster, r["victim"], r["epoch"])
    assert reference is not None
    result = summarize(reference, reps, sizes, load_at_start)
    result["restarts"] = not args.no_restart
    return result


def summarize(reference: dict[str, Any], reps: list[dict[str, Any]], sizes: Sizes,
              load: float) -> dict[str, Any]:
    def per_rep(key: str, q: int) -> list[float]:
        return [ms for r in reps if (ms := percentile_ms(r[key], q)) is not None]

    itl_p50 = 1e3 * percentile(reference["itl_s"], 50)
    result = {
        "gap_p50_ms": common.median(per_rep("gaps_s", 50)),
        "gap_p99_ms": common.median(per_rep("gaps_s", 99)),
        "router_gap_p50_ms": common.median(per_rep("router_gaps_s", 50)),
        "router_gap_p99_ms": common.median(per_rep("router_gaps_s", 99)),
        "peer_itl_p50_ms": itl_p50, "peer_itl_p99_ms": 1e3 * percentile(reference["itl_s"], 99),
        "identical_tokens": all(r["identical_tokens"] for r in reps),
        "reps": [{"victim": r["victim"], "moved": r["moved"], "identical_tokens": r["identical_tokens"],
                  "gap_p50_ms": percentile_ms(r["gaps_s"], 50), "gap_p99_ms": percentile_ms(r["gaps_s"], 99),
                  "gaps_ms": [1e3 * g for g in r["gaps_s"]]} for r in reps],
        "sizes": sizes.__dict__, "kill_after_tokens": KILL_AFTER,
        "environment": {**common.environment(os.cpu_count() or 1), "loadavg_at_start": load},
    }
    result["gap_p50_over_itl_p50"] = result["gap_p50_ms"] / itl_p50
    return result


def percentile_ms(seconds: list[float], q: int) -> float | None:
    value = percentile(seconds, q)
    return None if value is None else 1e3 * value


def report(r: dict[str, Any]) -> str:
    rows = [["gap at the client", r["gap_p50_ms"], r["gap_p99_ms"]],
            ["gap at the router", r["router_gap_p50_ms"], r["router_gap_p99_ms"]],
            ["peer: inter-token gap, no kill", r["peer_itl_p50_ms"], r["peer_itl_p99_ms"]]]
    s, env = r["sizes"], r["environment"]
    head = (f"kills={s['reps']} ({'restarted' if r['restarts'] else 'not restarted'}) "
            f"streams={s['streams']} new tokens={s['new_tokens']} kill after "
            f"{r['kill_after_tokens']} tokens; moved per kill {[x['moved'] for x in r['reps']]}; identical "
            f"tokens {r['identical_tokens']}; load average at start {env['loadavg_at_start']:.2f}")
    return "\n".join([head, common.format_table(["measure (median over kills)", "p50 ms", "p99 ms"], rows)])


def parse_args(argv: list[str] | None = None) -> Any:
    p = common.bench_parser("python -m bench.migration", __doc__)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 kill, 4 streams of 32 tokens")
    p.add_argument("--reps", type=int, default=None,
                   help=f"kills, after one warm-up rep (default {Sizes.reps})")
    p.add_argument("--streams", type=int, default=None, help=f"streams a rep (default {Sizes.streams})")
    p.add_argument("--no-restart", action="store_true",
                   help="the killed worker is not restarted (max_restarts 0; a cluster per kill), so "
                        "no model load competes with the replay for the cores")
    p.add_argument("--new-tokens", type=int, default=None,
                   help=f"tokens a stream, more than {KILL_AFTER} (default {Sizes.new_tokens})")
    return common.check_least(p, p.parse_args(argv), {"reps": 1, "streams": 2, "new_tokens": KILL_AFTER + 2})


def main(argv: list[str] | None = None) -> None:
    common.run_timed(run, report, parse_args(argv))


if __name__ == "__main__":
    main()
