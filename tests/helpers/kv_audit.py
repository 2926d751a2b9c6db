"""The KV audit every fault test ends with: no worker may cache a block that is not its prompt's KV.

Each worker recomputes its cached blocks from their token prefixes and compares (Worker.Audit,
pdserve/engine/audit.py). Used by the cluster tests (Ray actors) and the transfer tests
(in-process WorkerServers) alike: it takes worker addresses.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections.abc import Iterable, Sequence

import grpc

from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc


def audit_failures(addresses: Iterable[str], sample: int = 0, timeout_s: float = 300.0,
                   metadata: Sequence[tuple[str, str]] = ()) -> dict[str, worker_pb2.AuditReply]:
    """KV audit (Worker.Audit) of every cached block on each worker, in parallel: the replies of the
    workers where a block failed the comparison or the audit could not check everything (empty when
    every cached block is right). Takes addresses, so it serves a cluster's workers
    (worker_addresses(cluster)) and in-process WorkerServers ([w.address for w in servers]) alike;
    metadata carries the cluster secret where there is one. An unreachable worker raises."""

    def audit(address: str) -> worker_pb2.AuditReply:
        with grpc.insecure_channel(address) as channel:
            return worker_pb2_grpc.WorkerStub(channel).Audit(worker_pb2.AuditRequest(sample=sample),
                                                             timeout=timeout_s, metadata=metadata)

    addresses = list(addresses)
    with cf.ThreadPoolExecutor(max(1, len(addresses))) as pool:
        replies = dict(zip(addresses, pool.map(audit, addresses)))
    for address, r in replies.items():
        logging.getLogger(__name__).info(
            "KV audit of %s (%s): %d cached, %d checked, %d bit-exact, %d mismatched, %d skipped, worst "
            "relative difference %.2g, %.1f s", r.worker_id, address, r.cached_blocks, r.checked, r.exact,
            r.mismatched, r.skipped, r.max_rel_diff, r.elapsed_ms / 1e3)
    return {address: r for address, r in replies.items() if r.mismatched or not r.complete}
