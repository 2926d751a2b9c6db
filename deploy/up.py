"""`pdserve up`: read the topology, start the cluster, answer a sample chat, serve until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from deploy.config import ClusterSpec, flag_values, load_config, with_overrides
from deploy.launcher import LocalCluster
from pdserve.security import SecurityConfig
from pdserve.security.redis_auth import RedisAuthFailed

SAMPLE_QUESTION = "What is the capital of France?"


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    """The --config file's topology (or the defaults), with every flag given on the command line on top."""
    base = load_config(args.config) if args.config else ClusterSpec()
    return with_overrides(base, flag_values(args))


def answer_sample(address: str, security: SecurityConfig) -> None:
    from pdserve.client import PdserveClient
    from pdserve.client_security import client_kwargs

    with PdserveClient(address, timeout_s=120, **client_kwargs(security)) as client:
        print(f"\nuser: {SAMPLE_QUESTION}\nassistant: ", end="", flush=True)
        stream = client.stream(SAMPLE_QUESTION, temperature=0, max_tokens=64)
        for delta in stream.deltas():
            print(delta.text, end="", flush=True)
        done = stream.result()
        u = done.usage
        print(f"\n[{u['prompt_tokens']} prompt tokens, {u['completion_tokens']} generated · "
              f"ttft {done.timings['ttft_ms']:.0f} ms · prefill {done.prefill_worker or 'on decode worker'}"
              f" · decode {done.decode_worker}]\n", flush=True)


def client_flags(spec: ClusterSpec, num_tokens: int) -> str:
    """The flags a `pdserve generate --router` needs for this cluster ('' when it is open)."""
    flags = []
    if spec.tls.ca is not None:
        flags.append(f"--tls-ca {spec.tls.ca}")
    if spec.tls.require_client_cert:
        flags.append(f"--tls-client-cert {spec.tls.client_cert} --tls-client-key {spec.tls.client_key}")
    if spec.api_token_file is not None:
        # NOTE: a client sends one token; the router's file may list several.
        flags.append(f"--api-token-file {spec.api_token_file if num_tokens == 1 else 'ONE-TOKEN-FILE'}")
    return "".join(f" {flag}" for flag in flags)


def run_up(args: argparse.Namespace) -> int:
    if args.detach:
        from deploy.detached import run_up_detached

        return run_up_detached(args)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    cluster = LocalCluster(spec_from_args(args))
    if args.config:
        print(f"config   {args.config}", flush=True)
    try:
        address = cluster.start()
        if not args.no_sample:
            answer_sample(address, cluster.client_security())
        flags = client_flags(cluster.spec, len(cluster.security.api_tokens))
        print(f"serving on {address}; try:  pdserve generate --router {address}{flags} \"Hello\"\n"
              "press Ctrl-C to stop", flush=True)
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    except RedisAuthFailed as exc:  # a user error, like a bad flag: no traceback
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        # NOTE: a second Ctrl-C must not cut the teardown short and strand processes.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("stopping: router, workers, Ray, Redis ...", file=sys.stderr, flush=True)
        cluster.stop()
        print("stopped.", file=sys.stderr, flush=True)
    return 0
