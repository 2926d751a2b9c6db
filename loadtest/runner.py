"""The load generator: sends a workload's requests to a router over gRPC and records each one.

    report = run_loadtest(LoadTestConfig(router="127.0.0.1:50051", workload=Mixed(),
                                         arrivals=Poisson(rate=4.0), bounds=Bounds(200)))

A run: check the router answers (fail fast if not) -> scrape the metrics URL -> send the
requests on the arrival schedule, each streamed and timed on this process's monotonic clock
-> scrape again -> build the report (stats.build_report) -> optionally write it (report.py).

A request's life here: Due (its arrival time came, or a closed-loop sender took it) ->
Waiting for its conversation's previous turn (multi-turn only) -> Sent -> Streaming ->
Finished (OK) / Failed (a gRPC status) / Skipped (an earlier turn of its conversation failed,
or the duration ran out while it waited). No request starts after the duration; requests in
flight then run to their end, each bounded by its deadline (RequestOptions.timeout_s).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from tqdm import tqdm

from loadtest.arrivals import Arrivals, Bounds, ClosedLoop, Poisson, scheduled_offsets
from loadtest.server_metrics import MetricsProbe, discover_metrics_url
from loadtest.stats import SLO, RequestRecord, build_report
from loadtest.workloads import ConversationHistory, RequestSpec, Synthetic, Workload, workload_params
from pdserve.client import TIMING_FIELDS, USAGE_FIELDS, AsyncPdserveClient, PdserveError
from pdserve.client_security import client_kwargs
from pdserve.security import SecurityConfig
from protos.pdserve.v1 import generation_pb2 as pb


@dataclass(frozen=True)
class RequestOptions:
    """How every request is sent."""

    temperature: float | None = 0.0  # None: the router's default (the served model's)
    ignore_eos: bool = True  # generate exactly max_tokens, so output lengths follow the workload
    routing: str | None = None  # per-request policy override: prefix | least_load | round_robin
    timeout_s: float = 300.0  # deadline of each request


@dataclass(frozen=True)
class LoadTestConfig:
    router: str  # HOST:PORT
    workload: Workload = field(default_factory=Synthetic)
    arrivals: Arrivals = field(default_factory=lambda: ClosedLoop(1))
    bounds: Bounds = field(default_factory=lambda: Bounds(100, 600.0))
    seed: int = 0
    slo: SLO = field(default_factory=SLO)
    options: RequestOptions = field(default_factory=RequestOptions)
    metrics_url: str | None = None  # the router's Prometheus endpoint; None: ask the router (Admin)
    progress: bool = False
    connect_timeout_s: float = 10.0
    label: str = ""  # names this run in compare mode
    security: SecurityConfig | None = None  # TLS and the API token to dial with; None: plaintext, no token

    def describe(self) -> dict[str, Any]:
        """The report's record of what was run."""
        return {"label": self.label or self.router, "router": self.router,
                "workload": {"name": self.workload.name, "params": workload_params(self.workload)},
                "seed": self.seed, "arrival": self.arrivals.describe(),
                "bounds": {"requests": self.bounds.requests, "duration_s": self.bounds.duration_s},
                "request_options": dataclasses.asdict(self.options)}


@dataclass(frozen=True)
class RunResult:
    report: dict[str, Any]
    records: list[RequestRecord]


def run_loadtest(config: LoadTestConfig, out_dir: str | None = None) -> dict[str, Any]:
    """Run the load test and return the report dict; with out_dir, also write report.json,
    requests.jsonl and the PNG plots there. Not callable from inside a running event loop:
    await run_loadtest_async there."""
    result = asyncio.run(run_loadtest_async(config))
    if out_dir is not None:
        from loadtest.report import write_outputs

        write_outputs(out_dir, result.report, result.records)
    return result.report


async def run_loadtest_async(config: LoadTestConfig) -> RunResult:
    security = config.security or SecurityConfig()
    await wait_for_router(config.router, config.connect_timeout_s, security)
    metrics_url = config.metrics_url or await asyncio.to_thread(discover_metrics_url, config.router,
                                                                security=security)
    probe = MetricsProbe(metrics_url) if metrics_url else None
    if probe:
        await asyncio.to_thread(probe.before)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    specs = config.workload.requests(config.bounds.requests, random.Random(config.seed))
    async with AsyncPdserveClient(config.router, timeout_s=config.options.timeout_s,
                                  **client_kwargs(security)) as client:
        run = _Run(client, config)
        with run.progress_bar():
            await run.drive(specs)
    meta = {**config.describe(), "started_at": started_at, "started_unix_s": round(run.started_unix_s, 3),
            "stopped_by": run.stopped_by()}
    report = build_report(run.records, duration_s=run.duration_s(), slo=config.slo, skipped=run.skipped,
                          meta=meta)
    report["server_metrics"] = await asyncio.to_thread(probe.after) if probe else None
    return RunResult(report, sorted(run.records, key=lambda r: r.index))


async def wait_for_router(target: str, timeout_s: float, security: SecurityConfig | None = None) -> None:
    """Raise ValueError (a user error) if no connection to target is made within timeout_s."""
    async with (security or SecurityConfig()).open_channel(target, internal=False, aio=True) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout_s)
        except TimeoutError:
            raise ValueError(f"cannot reach the router at {target} within {timeout_s:g} s; "
                             "is `pdserve up` running there?") from None


def request_fields(spec: RequestSpec, history: ConversationHistory, options: RequestOptions,
                   seed: int) -> dict[str, Any]:
    """The AsyncPdserveClient.stream keywords for spec."""
    prompt = ({"token_ids": list(spec.token_ids)} if spec.token_ids
              else {"messages": history.messages_for(spec)})
    return {**prompt, "request_id": f"loadtest-{seed}-{spec.index}", "max_tokens": spec.max_tokens,
            "temperature": options.temperature, "ignore_eos": options.ignore_eos,
            "routing": options.routing}


class _Run:
    """One run's mutable state: records, conversation histories, turn completions."""

    def __init__(self, client: AsyncPdserveClient, config: LoadTestConfig) -> None:
        self.client, self.config = client, config
        self.records: list[RequestRecord] = []
        self.skipped = 0
        self.history = ConversationHistory()
        self._turn_done: dict[tuple[int, int], asyncio.Event] = {}
        self._failed_conversations: set[int] = set()
        self._t0 = time.perf_counter()
        self.started_unix_s = time.time()  # the wall-clock instant of now() == 0 (send_s, end_s)
        self._bar: tqdm | None = None

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def duration_s(self) -> float:
        return max((r.end_s for r in self.records), default=0.0)

    def stopped_by(self) -> str:
        return "requests" if len(self.records) + self.skipped >= self.config.bounds.requests else "duration"

    def progress_bar(self) -> tqdm:
        self._bar = tqdm(total=self.config.bounds.requests, unit="req", desc=self.config.label or "loadtest",
                         disable=not self.config.progress, dynamic_ncols=True)
        return self._bar

    def _past_deadline(self) -> bool:
        return self.config.bounds.duration_s is not None and self.now() >= self.config.bounds.duration_s

    # --- arrivals ---------------------------------------------------------------------------

    async def drive(self, specs: Iterator[RequestSpec]) -> None:
        arrivals = self.config.arrivals
        if isinstance(arrivals, Poisson):
            rng = random.Random(f"{self.config.seed}/arrivals")
            await self._open_loop(specs, scheduled_offsets(arrivals.rate, rng, self.config.bounds))
        else:
            await asyncio.gather(*(self._sender(specs) for _ in range(arrivals.concurrency)))

    async def _open_loop(self, specs: Iterator[RequestSpec], offsets: Iterable[float]) -> None:
        tasks = []
        for spec, offset in zip(specs, offsets):
            delay = offset - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self._issue(spec)))
        await asyncio.gather(*tasks)

    async def _sender(self, specs: Iterator[RequestSpec]) -> None:
        """A closed-loop sender: one request at a time until the specs or the time run out.
        NOTE: the senders share one iterator; asyncio runs them on one thread, so each spec
        goes to exactly one sender."""
        while not self._past_deadline():
            spec = next(specs, None)
            if spec is None:
                return
            await self._issue(spec)

    # --- one request ------------------------------------------------------------------------

    async def _issue(self, spec: RequestSpec) -> None:
        if spec.conversation is not None and spec.turn > 0:
            await self._turn_event(spec.conversation, spec.turn - 1).wait()
            if spec.conversation in self._failed_conversations or self._past_deadline():
                self._skip(spec)
                return
        record, reply = await self._send(spec)
        self.records.append(record)
        if spec.conversation is not None:
            if record.ok:
                self.history.record_reply(spec, reply)
            else:
                self._failed_conversations.add(spec.conversation)
            self._turn_event(spec.conversation, spec.turn).set()
        self._advance(record)

    def _skip(self, spec: RequestSpec) -> None:
        self.skipped += 1
        self._failed_conversations.add(spec.conversation)
        self._turn_event(spec.conversation, spec.turn).set()
        self._advance(None)

    def _turn_event(self, conversation: int, turn: int) -> asyncio.Event:
        return self._turn_done.setdefault((conversation, turn), asyncio.Event())

    def _advance(self, record: RequestRecord | None) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        failed = sum(not r.ok for r in self.records)
        if failed or self.skipped:
            self._bar.set_postfix(failed=failed, skipped=self.skipped, refresh=False)

    async def _send(self, spec: RequestSpec) -> tuple[RequestRecord, str]:
        fields = request_fields(spec, self.history, self.config.options, self.config.seed)
        times: list[float] = []
        counts: list[int] = []
        text: list[str] = []
        final: pb.GenerateResponse | None = None
        status, error = "OK", None
        sent = self.now()
        try:
            async with self.client.stream(**fields) as stream:
                async for response in stream:
                    if response.token_ids:
                        times.append(self.now())
                        counts.append(len(response.token_ids))
                    text.append(response.text)
                    if response.finished:
                        final = response
            if final is None:
                status, error = "INTERNAL", "the stream ended without its final message (finished=true)"
        except PdserveError as exc:
            status, error = exc.code, exc.message
        end = self.now()
        record = RequestRecord(
            index=spec.index, send_s=sent, end_s=end, status=status, token_times_s=tuple(times),
            token_counts=tuple(counts), error=error, max_tokens=spec.max_tokens, kind=spec.kind,
            conversation=spec.conversation, turn=spec.turn, **_final_fields(final))
        return record, "".join(text)


def _final_fields(final: pb.GenerateResponse | None) -> dict[str, Any]:
    if final is None:
        return {}
    return {"usage": {k: getattr(final.usage, k) for k in USAGE_FIELDS},
            "server_timings_ms": {k: getattr(final.timings, k) for k in TIMING_FIELDS},
            "prefill_worker": final.prefill_worker or None, "decode_worker": final.decode_worker or None,
            "finish_reason": final.finish_reason}

