"""`pdserve up`: read the topology, start the cluster, answer a sample chat, serve until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from deploy.config import ClusterSpec, load_config, with_overrides
from deploy.launcher import LocalCluster

SAMPLE_QUESTION = "What is the capital of France?"
# `pdserve up` flags (argparse dests) -> the ClusterSpec fields they set; most keep their name
_RENAMED = {"model": "model_path", "prefill": "num_prefill", "decode": "num_decode", "address": "ray_address"}
FLAG_FIELDS = {dest: _RENAMED.get(dest, dest) for dest in (
    "model", "prefill", "decode", "placement", "gpus_per_worker", "host", "port", "metrics_port", "redis_url",
    "address", "namespace", "block_size", "kv_dtype", "num_blocks", "kv_cache_gib", "max_batched_tokens",
    "routing", "min_remote_prefill_tokens")}


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    """The --config file's topology (or the defaults), with every flag given on the command line on top."""
    base = load_config(args.config) if args.config else ClusterSpec()
    return with_overrides(base, {name: getattr(args, flag) for flag, name in FLAG_FIELDS.items()})


def answer_sample(address: str) -> None:
    from pdserve.client import PdserveClient

    with PdserveClient(address, timeout_s=120) as client:
        print(f"\nuser: {SAMPLE_QUESTION}\nassistant: ", end="", flush=True)
        stream = client.stream(SAMPLE_QUESTION, temperature=0, max_tokens=64)
        for delta in stream.deltas():
            print(delta.text, end="", flush=True)
        done = stream.result()
        u = done.usage
        print(f"\n[{u['prompt_tokens']} prompt tokens, {u['completion_tokens']} generated · "
              f"ttft {done.timings['ttft_ms']:.0f} ms · prefill {done.prefill_worker or 'on decode worker'}"
              f" · decode {done.decode_worker}]\n", flush=True)


def run_up(args: argparse.Namespace) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    cluster = LocalCluster(spec_from_args(args))
    if args.config:
        print(f"config   {args.config}", flush=True)
    try:
        address = cluster.start()
        if not args.no_sample:
            answer_sample(address)
        print(f"serving on {address}; try:  pdserve generate --router {address} \"Hello\"\n"
              "press Ctrl-C to stop", flush=True)
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        # NOTE: a second Ctrl-C must not cut the teardown short and strand processes.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("stopping: router, workers, Ray, Redis ...", file=sys.stderr, flush=True)
        cluster.stop()
        print("stopped.", file=sys.stderr, flush=True)
    return 0
