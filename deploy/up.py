"""`pdserve up`: start the cluster, answer one sample chat, serve until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from deploy.launcher import ClusterSpec, LocalCluster

SAMPLE_QUESTION = "What is the capital of France?"


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    return ClusterSpec(model_path=args.model, num_prefill=args.prefill, num_decode=args.decode,
                       host=args.host, port=args.port, redis_url=args.redis_url, ray_address=args.address,
                       block_size=args.block_size, kv_dtype=args.kv_dtype, num_blocks=args.num_blocks,
                       kv_cache_gib=args.kv_cache_gib, max_batched_tokens=args.max_batched_tokens,
                       min_remote_prefill_tokens=args.min_remote_prefill_tokens, routing=args.routing)


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
