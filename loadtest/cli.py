"""`pdserve loadtest` and `python -m loadtest`: the same flags, the same handler.

This module imports only argparse, the (pure) workloads and transport interface and the routing
policies (router/config.py) at load time, because `pdserve --help` builds every subcommand's parser; the
runner (grpc) and the plots (matplotlib) are imported when a run starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence

from loadtest.transport import APIS
from loadtest.workloads import WORKLOADS, describe_workloads, make_workload, parse_params
from pdserve.client_security import add_client_security_arguments, security_from_args
from router.config import ROUTING_POLICIES

DESCRIPTION = (
    "Load-test a running pdserve router: send a workload's requests over gRPC (or, with --api openai "
    "--url URL, over its OpenAI-compatible HTTP API), open loop (Poisson "
    "arrivals at --rate) or closed loop (--concurrency in flight), bounded by --requests and "
    "--duration; report TTFT, ITL, TPOT and E2E latency (p50/p90/p99), tokens/s, goodput, prefix "
    "hit rate and errors by gRPC (or HTTP) status. --out DIR writes report.json, requests.jsonl and "
    "PNG plots. Compare mode: --against / --against-routing run the same workload twice, or --compare reads "
    "two report.json files; both print the ratios B/A.")
EXIT_INTERRUPTED = 130


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `loadtest` subcommand on a parent parser's subparsers."""
    p = subparsers.add_parser("loadtest", help="load-test a running router and report latency, "
                                               "throughput, goodput and prefix hit rate",
                              description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(handler=run)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest", description=DESCRIPTION)
    add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    _add_workload_arguments(p)
    _add_objective_arguments(p)
    _add_request_arguments(p)
    p.add_argument("--metrics-url", metavar="URL",
                   help="the router's Prometheus endpoint (e.g. http://127.0.0.1:9100/metrics); "
                        "scraped before and after, its counter deltas go in the report's server_metrics "
                        "(default: the address the router gives in its Admin ClusterStatus)")
    p.add_argument("--label", help="name of this run in the report and plots (default: the router address "
                                   "or --url)")
    p.add_argument("--against", metavar="HOST:PORT|URL",
                   help="compare mode: run the same workload against this second router (B) "
                        "after --router (A); with --api openai, a second base URL after --url")
    p.add_argument("--against-routing", choices=ROUTING_POLICIES,
                   help="compare mode: B is the same run with this routing override (against --router, "
                        "or --against when given)")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="compare two existing report.json files instead of running anything")
    p.add_argument("--json", action="store_true",
                   help="print the report (or comparison) as JSON instead of a table")
    p.add_argument("--no-progress", action="store_true", help="do not show a progress bar")
    add_client_security_arguments(p)  # compare mode: the same for --router and --against


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """Where the requests go, what they are, how many and how fast."""
    p.add_argument("--api", choices=APIS, default="grpc",
                   help="how to send: grpc = pdserve's Generation API at --router; openai = the "
                        "OpenAI-compatible HTTP API at --url (/v1/chat/completions for chat prompts, "
                        "/v1/completions for token ids, streamed) (default: %(default)s)")
    p.add_argument("--router", metavar="HOST:PORT[,HOST:PORT...]",
                   help="address of the router to load (e.g. 127.0.0.1:50051, `pdserve up`'s), or several "
                        "comma-separated, spread round robin (router-side counters then need --metrics-url); "
                        "this is A in compare mode (--api grpc)")
    p.add_argument("--url", metavar="URL",
                   help="--api openai: the HTTP API's base URL, e.g. http://127.0.0.1:8000 "
                        "(`pdserve up --http-port`; a trailing /v1 is fine); A in compare mode")
    p.add_argument("--model", metavar="NAME",
                   help="--api openai: the model every request names (default: the first one "
                        "GET /v1/models lists)")
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="synthetic",
                   help="what to send: synthetic = random lengths; shared-prefix = long shared system "
                        "prompts; multi-turn = conversations whose turns carry the replies before; "
                        "long-doc = questions over long documents; mixed = long-prompt/short-answer "
                        "with short-prompt/long-answer requests (default: %(default)s)")
    p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                   help="a workload parameter, e.g. -p input_tokens=1024; repeat for several; "
                        "--list-workloads shows each workload's parameters and defaults")
    p.add_argument("--list-workloads", action="store_true",
                   help="print every workload's parameters with their defaults and exit")
    p.add_argument("--requests", type=int, default=100, metavar="N",
                   help="most requests to send (default: %(default)s)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=float, metavar="R",
                      help="open loop: Poisson arrivals at R requests/s (inf = all at once)")
    mode.add_argument("--concurrency", type=int, metavar="C",
                      help="closed loop: keep C requests in flight, each sent when one ends")
    p.add_argument("--duration", type=float, default=600.0, metavar="SECONDS",
                   help="start no request after this many seconds; requests in flight then finish "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the workload and the arrival times; same seed, same requests "
                        "(default: %(default)s)")


def _add_objective_arguments(p: argparse.ArgumentParser) -> None:
    """Where the report goes, and the latency objectives that define goodput."""
    p.add_argument("--out", metavar="DIR",
                   help="write report.json, requests.jsonl, latency_cdf.png and throughput.png here "
                        "(compare mode: a/, b/ and compare.json); default: print only")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, metavar="MS",
                   help="goodput: time-to-first-token objective in ms (default: %(default)s)")
    p.add_argument("--slo-itl-ms", type=float, default=200.0, metavar="MS",
                   help="goodput: inter-token latency objective in ms (default: %(default)s)")
    p.add_argument("--slo-itl-stat", choices=("p99", "max", "mean"), default="p99",
                   help="goodput: which statistic of a request's own ITLs must meet --slo-itl-ms "
                        "(default: %(default)s)")


def _add_request_arguments(p: argparse.ArgumentParser) -> None:
    """What every request asks of the router."""
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request; 0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, metavar="P",
                   help="nucleus sampling: every request samples from the top tokens of total "
                        "probability P (default: the server's)")
    p.add_argument("--top-k", type=int, metavar="K",
                   help="every request samples from its K most likely tokens (default: the server's)")
    p.add_argument("--sampling-seed", type=int, metavar="N",
                   help="seed of every request's sampler, so a request samples the same tokens "
                        "each run (default: none; --seed is the workload's)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="a stop string of every request; repeat for several (default: none)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly max_tokens, ignoring end-of-sequence, so output lengths "
                        "follow the workload (default: on)")
    p.add_argument("--routing", choices=ROUTING_POLICIES,
                   help="per-request routing policy override (default: the router's own policy)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="deadline of each request (default: %(default)s)")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="give up if the router does not accept a connection in this time "
                        "(default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    if args.list_workloads:
        print(describe_workloads())
        return 0
    if args.compare:
        from loadtest.compare import compare_files, format_comparison

        comparison = compare_files(*args.compare, out_dir=args.out)
        print(json.dumps(comparison, indent=2) if args.json else format_comparison(comparison))
        return 0
    config = config_from_args(args)
    try:
        if args.against or args.against_routing:
            return _run_compare(args, config)
        return _run_one(args, config)
    except KeyboardInterrupt:
        print("\ninterrupted; no report written", file=sys.stderr)
        return EXIT_INTERRUPTED


def config_from_args(args: argparse.Namespace):  # -> LoadTestConfig (imported lazily)
    from loadtest.arrivals import Bounds, ClosedLoop, Poisson
    from loadtest.runner import LoadTestConfig, RequestOptions
    from loadtest.stats import SLO

    if args.api == "grpc" and (args.url or args.model):
        raise ValueError("--url and --model go with --api openai; the gRPC API takes --router HOST:PORT")
    if args.api == "openai" and args.router:
        raise ValueError("--api openai sends to --url; drop --router (or use --api grpc)")
    if args.rate is None and args.concurrency is None:
        raise ValueError("give --rate R (open loop, Poisson) or --concurrency C (closed loop)")
    return LoadTestConfig(
        router=args.router or "", api=args.api, url=args.url or "", model=args.model,
        workload=make_workload(args.workload, parse_params(args.param)),
        arrivals=Poisson(args.rate) if args.rate is not None else ClosedLoop(args.concurrency),
        bounds=Bounds(args.requests, args.duration),
        seed=args.seed,
        slo=SLO(args.slo_ttft_ms, args.slo_itl_ms, args.slo_itl_stat),
        options=RequestOptions(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                               sampling_seed=args.sampling_seed, stop=tuple(args.stop),
                               ignore_eos=args.ignore_eos, routing=args.routing, timeout_s=args.timeout),
        metrics_url=args.metrics_url, progress=not args.no_progress,
        connect_timeout_s=args.connect_timeout, label=args.label or "", security=security_from_args(args))


def _run_one(args: argparse.Namespace, config) -> int:
    from loadtest.report import format_summary
    from loadtest.runner import run_loadtest

    report = run_loadtest(config, args.out)
    print(json.dumps(report, indent=2) if args.json else format_summary(report))
    if args.out and not args.json:
        print(f"wrote {os.path.join(args.out, 'report.json')} and plots")
    return 0 if report["counts"]["completed"] else 1


def _run_compare(args: argparse.Namespace, config) -> int:
    from loadtest.compare import format_comparison, run_compare

    if args.metrics_url:
        # NOTE: one URL cannot describe two routers; B's counters would be A's.
        raise ValueError("--metrics-url applies to a single run; drop it in compare mode")
    label_a = config.label or _describe(config.target, config.options.routing)
    target_b = args.against or config.target
    routing_b = args.against_routing or config.options.routing
    where_b = {"url": target_b} if config.api == "openai" else {"router": target_b}
    config_a = dataclasses.replace(config, label=label_a)
    config_b = dataclasses.replace(config, **where_b, label=_describe(target_b, routing_b),
                                   options=dataclasses.replace(config.options, routing=routing_b))
    result = run_compare(config_a, config_b, args.out)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "reports"}, indent=2))
    else:
        print(format_comparison(result))
    failed = [r for r in result["reports"].values() if not r["counts"]["completed"]]
    return 1 if failed else 0


def _describe(router: str, routing: str | None) -> str:
    return f"{router} routing={routing}" if routing else router
