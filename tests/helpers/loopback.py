"""In-process transport: frames go straight into a KVReceiver. For tests of the logic around it."""

from __future__ import annotations

from collections.abc import Iterator

from decode_worker.receiver import KVReceiver
from pdserve.transfer.channel import Frame, PushResult


class LoopbackKVChannel:
    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver

    def push(self, frames: Iterator[Frame], timeout_s: float) -> PushResult:
        sent = 0

        def counted() -> Iterator[Frame]:
            nonlocal sent
            for header, payload in frames:
                sent += len(payload)
                yield header, payload

        report = self.receiver.receive(counted())
        return PushResult(report.transfer_id, report.blocks_written, sent)
