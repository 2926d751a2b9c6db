"""The sending end: a prompt's KV leaves layer by layer while prefill is still running.

    compute thread                          sender thread (one per transfer)
    engine.step(on_layer_done=sender)       channel.push(frames()) pulls:
      layer i written -> sender(i, chunks)    BEGIN
        -> OutgoingTransfer.offer()  --queue-->  LAYER frames (gathered from the pool)
    request finished -> transfer.close()  --->  END

Lifecycle of an OutgoingTransfer (TransferState): PENDING (created) -> TRANSFERRING
(push under way) -> DONE (receiver confirmed) | FAILED (TransferFailed from wait()).

Only whole blocks are sent, each exactly once per layer: a block goes out once the
chunk that completes it has been computed, and the partial last block of the prompt
goes with the final chunk. Blocks the receiver already holds are never sent. The
engine keeps the request's blocks referenced (hold_blocks) until the caller releases
them after wait(), so the sender thread never reads a block that was reused.
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine.scheduler import ScheduledChunk
from pdserve.kvwire import KVLayout, TransferBegin, TransferEnd, encode_layer
from pdserve.transfer.errors import FailureKind, TransferFailed
from pdserve.transfer.receiver import TransferState

Frame = tuple[bytes, bytes]


@dataclass(frozen=True)
class PushResult:
    transfer_id: str
    blocks_written: int
    bytes_sent: int


class KVChannel(Protocol):
    """Carries one transfer's frames to a receiver; raises TransferFailed on failure."""

    def push(self, frames: Iterator[Frame], timeout_s: float) -> PushResult: ...


@dataclass(frozen=True)
class _LayerWork:
    layer: int
    block_ids: list[int]
    positions: list[int]


_END = object()
_ABORT = object()


class OutgoingTransfer:
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, begin: TransferBegin, channel: KVChannel,
                 timeout_s: float, max_chunk_bytes: int) -> None:
        self.kv_cache, self.layout, self.begin = kv_cache, layout, begin
        self.timeout_s, self.max_chunk_bytes = timeout_s, max_chunk_bytes
        self.state = TransferState.PENDING
        self.bytes_sent = 0
        self._channel = channel
        self._next_position = [begin.receiver_cached_blocks] * layout.num_layers
        self._total_blocks = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._result: PushResult | None = None
        self._error: TransferFailed | None = None
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{begin.request_id}", daemon=True)

    @property
    def request_id(self) -> str:
        return self.begin.request_id

    def start(self) -> None:
        self.state = TransferState.TRANSFERRING
        self._thread.start()

    def offer(self, layer: int, chunk: ScheduledChunk) -> None:
        """Called on the compute thread once `layer` of `chunk` is written to the pool."""
        bs = self.layout.block_size
        n = self.begin.num_tokens
        complete = -(-n // bs) if chunk.end >= n else chunk.end // bs
        first = self._next_position[layer]
        if complete <= first:
            return
        positions = list(range(first, complete))
        self._next_position[layer] = complete
        self._total_blocks += len(positions)
        self._queue.put(_LayerWork(layer, [chunk.seq.block_ids[p] for p in positions], positions))

    def close(self) -> None:
        """Prefill finished: every block has been offered; send END."""
        self._queue.put(_END)

    def abort(self) -> None:
        self._queue.put(_ABORT)

    def wait(self) -> PushResult:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _run(self) -> None:
        try:
            self._result = self._channel.push(self._frames(), self.timeout_s)
            self.state = TransferState.DONE
        except TransferFailed as e:
            self._error, self.state = e, TransferState.FAILED
        except Exception as e:  # a transport bug must still end the transfer cleanly
            self._error = TransferFailed(FailureKind.INTERNAL, f"{type(e).__name__}: {e}")
            self.state = TransferState.FAILED

    def _frames(self) -> Iterator[Frame]:
        yield self.begin.encode(), b""
        while True:
            work = self._queue.get()
            if work is _ABORT:
                raise TransferFailed(FailureKind.CANCELLED, "the prefill side aborted the transfer")
            if work is _END:
                yield TransferEnd(self.begin.transfer_id, self._total_blocks, self.bytes_sent).encode(), b""
                return
            for header, payload in encode_layer(self.kv_cache, work.layer, work.block_ids, work.positions,
                                                self.begin.transfer_id, self.max_chunk_bytes):
                self.bytes_sent += len(payload)
                yield header, payload


class LayerwiseSender:
    """The prefill engine's layer hook: routes each written layer to the transfers it feeds."""

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, max_chunk_bytes: int = 2 << 20) -> None:
        self.kv_cache, self.layout, self.max_chunk_bytes = kv_cache, layout, max_chunk_bytes
        self._transfers: dict[str, OutgoingTransfer] = {}
        self._lock = threading.Lock()

    def start(self, request_id: str, prompt_token_ids: list[int], receiver_cached_blocks: int,
              channel: KVChannel, timeout_s: float) -> OutgoingTransfer:
        total = -(-len(prompt_token_ids) // self.layout.block_size)
        begin = TransferBegin(uuid.uuid4().hex, request_id, self.layout, tuple(prompt_token_ids),
                              len(prompt_token_ids), receiver_cached_blocks,
                              tuple(range(receiver_cached_blocks, total)))
        transfer = OutgoingTransfer(self.kv_cache, self.layout, begin, channel, timeout_s,
                                    self.max_chunk_bytes)
        with self._lock:
            self._transfers[request_id] = transfer
        transfer.start()
        return transfer

    def finish(self, request_id: str) -> None:
        with self._lock:
            self._transfers.pop(request_id, None)

    def __call__(self, layer: int, chunks: list[ScheduledChunk]) -> None:
        with self._lock:
            if not self._transfers:
                return
            for chunk in chunks:
                transfer = self._transfers.get(chunk.seq.request_id)
                if transfer is not None:
                    transfer.offer(layer, chunk)
