"""The load generator: sends a workload's requests to a server and records each one.

    report = run_loadtest(LoadTestConfig(router="127.0.0.1:50051", workload=Mixed(),
                                         arrivals=Poisson(rate=4.0), bounds=Bounds(200)))
    report = run_loadtest(LoadTestConfig(api="openai", url="http://127.0.0.1:8000", ...))

A run: open the transport (transport.py: gRPC to the router, or OpenAI's HTTP API) -> check the
server answers (fail fast if not) -> scrape the metrics URL -> send the requests on the arrival
schedule, each streamed and timed on this process's monotonic clock -> scrape again -> build the
report (stats.build_report) -> optionally write it (report.py).

A request's life here: Due (its arrival time came, or a closed-loop sender took it) ->
Waiting for its conversation's previous turn (multi-turn only) -> Sent -> Streaming ->
Finished (OK) / Failed (a gRPC status, or an HTTP one) / Skipped (an earlier turn of its conversation failed,
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
from loadtest.server_metrics import MetricsProbe
from loadtest.stats import SLO, RequestRecord, build_report
from loadtest.transport import APIS, GenerationRequest, Reply, Sampling, Transport
from loadtest.workloads import ConversationHistory, RequestSpec, Synthetic, Workload, workload_params
from pdserve.security import SecurityConfig


@dataclass(frozen=True)
class RequestOptions:
    """How every request is sent."""

    temperature: float | None = 0.0  # None: the router's default (the served model's)
    top_p: float | None = None  # None: the server's default, here and below
    top_k: int | None = None
    sampling_seed: int | None = None  # the seed of every request's sampler
    stop: tuple[str, ...] = ()
    ignore_eos: bool = True  # generate exactly max_tokens, so output lengths follow the workload
    routing: str | None = None  # per-request policy override: prefix | least_load | round_robin
    timeout_s: float = 300.0  # deadline of each request


@dataclass(frozen=True)
class LoadTestConfig:
    router: str = ""  # HOST:PORT of the router's gRPC API (api="grpc")
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
    api: str = "grpc"  # grpc: router over gRPC; openai: url over OpenAI's HTTP API
    url: str = ""  # api="openai": the base URL, e.g. http://127.0.0.1:8000 (`pdserve up --http-port`)
    model: str | None = None  # api="openai": every request's `model`; None: the first GET /v1/models lists

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}, got {self.api!r}")
        if self.api == "grpc" and not self.router:
            raise ValueError("--router HOST:PORT is required (or --compare A.json B.json)")
        if self.api == "openai":
            if not self.url:
                raise ValueError("--api openai needs --url, the HTTP API's base URL (e.g. http://127.0.0.1:8000)")
            if self.options.routing:
                raise ValueError("--routing is a field of pdserve's gRPC API; OpenAI's HTTP API has no "
                                 "per-request routing override: drop it, or use --api grpc")

    @property
    def target(self) -> str:
        """Where the requests go: the router's HOST:PORT, or the HTTP API's URL."""
        return self.url if self.api == "openai" else self.router

    def describe(self) -> dict[str, Any]:
        """The report's record of what was run."""
        return {"label": self.label or self.target, "router": self.target, "api": self.api,
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
    async with open_transport(config) as transport:
        await transport.check(config.connect_timeout_s)
        metrics_url = config.metrics_url or await transport.metrics_url()
        probe = MetricsProbe(metrics_url) if metrics_url else None
        if probe:
            await asyncio.to_thread(probe.before)
        started_at = datetime.now(UTC).isoformat(timespec="seconds")
        specs = config.workload.requests(config.bounds.requests, random.Random(config.seed))
        run = _Run(transport, config)
        with run.progress_bar():
            await run.drive(specs)
    meta = {**config.describe(), "started_at": started_at, "started_unix_s": round(run.started_unix_s, 3),
            "stopped_by": run.stopped_by()}
    report = build_report(run.records, duration_s=run.duration_s(), slo=config.slo, skipped=run.skipped,
                          meta=meta)
    report["server_metrics"] = await asyncio.to_thread(probe.after) if probe else None
    return RunResult(report, sorted(run.records, key=lambda r: r.index))


def open_transport(config: LoadTestConfig) -> Transport:
    """The transport config.api names (its client library is imported only when chosen)."""
    security = config.security or SecurityConfig()
    if config.api == "openai":
        from loadtest.openai_transport import OpenAITransport

        return OpenAITransport(config.url, timeout_s=config.options.timeout_s, security=security,
                               model=config.model)
    from loadtest.grpc_transport import GrpcTransport

    return GrpcTransport(config.router, timeout_s=config.options.timeout_s, security=security)


def generation_request(spec: RequestSpec, history: ConversationHistory, options: RequestOptions,
                       seed: int) -> GenerationRequest:
    """What to send for spec: its prompt (multi-turn: the history before it), the options' sampling."""
    sampling = Sampling(max_tokens=spec.max_tokens, temperature=options.temperature, top_p=options.top_p,
                        top_k=options.top_k, seed=options.sampling_seed, stop=options.stop,
                        ignore_eos=options.ignore_eos)
    messages = () if spec.token_ids else tuple(history.messages_for(spec))
    return GenerationRequest(request_id=f"loadtest-{seed}-{spec.index}", sampling=sampling,
                             messages=messages, token_ids=spec.token_ids, routing=options.routing)


class _Run:
    """One run's mutable state: records, conversation histories, turn completions."""

    def __init__(self, transport: Transport, config: LoadTestConfig) -> None:
        self.transport, self.config = transport, config
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
        request = generation_request(spec, self.history, self.config.options, self.config.seed)
        reply: Reply = await self.transport.stream(request, self.now)
        record = RequestRecord(index=spec.index, max_tokens=spec.max_tokens, kind=spec.kind,
                               conversation=spec.conversation, turn=spec.turn, **reply.record_fields())
        return record, reply.text
