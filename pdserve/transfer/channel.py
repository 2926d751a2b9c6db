"""The contract between the two ends of a KV transfer: what a prefill worker's sender hands a
channel, and what a channel hands back.

    prefill_worker/sender.py --Frames--> KVChannel.push --> decode_worker/receiver.py
                                         (prefill_worker/channels.py: gRPC; tests: loopback)

A Frame is (header, payload) as pdserve/kvwire.py encodes them: BEGIN, LAYER frames, END.
Lifecycle of one transfer (TransferState), at either end: PENDING -> TRANSFERRING -> DONE |
FAILED (TransferFailed, pdserve/transfer/errors.py, says why).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

Frame = tuple[bytes, bytes]


class TransferState(enum.Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class PushResult:
    transfer_id: str
    blocks_written: int
    bytes_sent: int


class KVChannel(Protocol):
    """Carries one transfer's frames to a receiver; raises TransferFailed on failure."""

    def push(self, frames: Iterator[Frame], timeout_s: float) -> PushResult: ...
