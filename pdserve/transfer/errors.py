"""Why a transfer failed, in terms both ends and any transport understand.

FailureKind names match gRPC status codes so the gRPC transport maps them
one to one; the pure sender/receiver never import grpc.
"""

from __future__ import annotations

import enum


class FailureKind(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # malformed frames or an impossible request
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # layout/fingerprint mismatch, cached prefix gone
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # the receiver's pool cannot hold the prompt
    DATA_LOSS = "DATA_LOSS"  # a block failed its checksum
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"  # the sender went away or gave up mid-stream
    ABORTED = "ABORTED"  # the sender's request lost its blocks (preempted): the caller prefills elsewhere
    UNAVAILABLE = "UNAVAILABLE"  # the receiver cannot be reached
    INTERNAL = "INTERNAL"


class TransferFailed(RuntimeError):
    """A KV transfer did not complete; nothing it wrote will be used. The caller recomputes."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(f"{kind.value}: {message}")
        self.kind = kind
        self.message = message
