"""FailureKind <-> gRPC status code, one to one (the kinds are named after the codes), for the two
gRPC ends of a KV transfer: prefill_worker/channels.py and decode_worker/kv_service.py."""

from __future__ import annotations

import grpc

from pdserve.transfer.errors import FailureKind

_TO_STATUS = {kind: getattr(grpc.StatusCode, kind.value) for kind in FailureKind}
_FROM_STATUS = {status: kind for kind, status in _TO_STATUS.items()}


def status_of(kind: FailureKind) -> grpc.StatusCode:
    return _TO_STATUS[kind]


def failure_of(code: grpc.StatusCode) -> FailureKind:
    """The kind a status code names; INTERNAL for a code no kind is named after."""
    return _FROM_STATUS.get(code, FailureKind.INTERNAL)
