"""The sending end: a prompt's KV leaves layer by layer while prefill is still running.

    compute thread (engine lock held)         sender thread (one per transfer)
    engine.step(observer=LayerwiseSender)     channel.push(frames()) pulls:
      layer i written -> layer_done(i, chunks)  BEGIN
        -> OutgoingTransfer.offer(): pin the    LAYER frames: check not aborted, gather one
           blocks, queue them   --queue-->        chunk of pinned blocks, yield it
    request finished -> close()  ------------>  check not aborted, END
    preempted -> preempted() -> abort()         (the next check raises: no END)

Lifecycle of an OutgoingTransfer (TransferState): PENDING (created) -> TRANSFERRING
(push under way) -> DONE (receiver confirmed) | FAILED (TransferFailed from wait() or abort()).

Only whole blocks are sent, each exactly once per layer: a block goes out once the chunk
that completes it has been computed, and the partial last block of the prompt goes with the
final chunk. Blocks the receiver already holds are never sent.

Why the output stays exact whatever happens to the request meanwhile:
- The sender holds its own reference on every block it has been offered (engine.handoff.pin,
  taken on the compute thread as the block is queued) until the transfer is released or
  aborted, so no block it still has to read can be handed to another request.
- An abort wins over END at any point. abort() sets the flag *before* it lets go of the
  blocks, and the sender checks the flag before every gather and before END. A gather that
  raced with the release may read a torn block, but the check after it stops the stream
  before END, and a receiver that never sees END discards the whole transfer.
- Preempting a request whose blocks are being sent aborts its transfer (and drops the
  request: the caller prefills elsewhere).
- A Prefill call that ends early stop()s its transfer (the flag alone: gRPC's event thread must
  not wait for the engine's lock), and the engine loop releases the blocks at its next turn.

A device pool (pdserve/transfer/staging.py; a CPU pool takes none of this): layer_done records an
event on the compute stream for each layer; the sender thread has its transfer stream wait on it,
gathers on the device and copies each frame into a pinned staging slot, waits for that copy's event
only, then hashes and sends. The slot is released once the frame is consumed, or when the transfer
ends either way (release_all). Neither thread holds the device: compute never waits for a transfer.
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass

from pdserve.engine.device_streams import Event
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.sequence import Sequence
from pdserve.kvwire import KVLayout, TransferBegin, TransferEnd, encode_layer
from pdserve.transfer.channel import Frame, KVChannel, PushResult, TransferState
from pdserve.transfer.errors import FailureKind, TransferFailed
from pdserve.transfer.frames import DEFAULT_MAX_CHUNK_BYTES
from pdserve.transfer.staging import StagedCopies, StagingTimeout, staging_for_pool
from pdserve.units import ceil_div


@dataclass(frozen=True)
class _LayerWork:
    layer: int
    block_ids: list[int]
    positions: list[int]
    ready: Event | None = None  # the layer's compute, on a device pool


_END = object()
_WAKE = object()  # abort() puts this so a sender waiting on the queue looks at the flag


class OutgoingTransfer:
    def __init__(self, engine: LLMEngine, layout: KVLayout, begin: TransferBegin, channel: KVChannel,
                 timeout_s: float, max_chunk_bytes: int, staged: StagedCopies | None = None) -> None:
        self.engine, self.layout, self.begin, self.staged = engine, layout, begin, staged
        self.timeout_s, self.max_chunk_bytes = timeout_s, max_chunk_bytes
        self.state = TransferState.PENDING
        self.bytes_sent = 0
        self._channel = channel
        self._next_position = [begin.decode_cached_blocks] * layout.num_layers
        self._total_blocks = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._result: PushResult | None = None
        self._error: TransferFailed | None = None
        self._aborted: TransferFailed | None = None
        self._gave_up: TransferFailed | None = None  # why this end stopped the stream, where it did
        self._pinned: list[int] = []  # one entry per reference this transfer holds
        self._pin_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{begin.request_id}", daemon=True)

    @property
    def request_id(self) -> str:
        return self.begin.request_id

    def start(self) -> None:
        self.state = TransferState.TRANSFERRING
        self._thread.start()

    def offer(self, layer: int, chunk: ScheduledChunk, ready: Event | None = None) -> None:
        """Called on the compute thread once `layer` of `chunk` is written to the pool (on a device
        pool: enqueued; `ready` completes when it is written)."""
        bs = self.layout.block_size
        n = self.begin.num_tokens
        complete = ceil_div(n, bs) if chunk.end >= n else chunk.end // bs
        first = self._next_position[layer]
        if complete <= first:
            return
        positions = list(range(first, complete))
        block_ids = [chunk.seq.block_ids[p] for p in positions]
        with self._pin_lock:
            if self._aborted is not None:
                return
            self.engine.handoff.pin(block_ids)  # NOTE: the compute thread holds the engine lock here
            self._pinned += block_ids
        self._next_position[layer] = complete
        self._total_blocks += len(positions)
        self._queue.put(_LayerWork(layer, block_ids, positions, ready))

    def close(self) -> None:
        """Prefill finished: every block has been offered; send END (unless aborted first)."""
        self._queue.put(_END)

    def abort(self, kind: FailureKind = FailureKind.CANCELLED,
              reason: str = "the prefill side aborted the transfer") -> TransferFailed:
        """stop() the transfer and let go of its blocks at once (this waits for the engine's lock)."""
        failure = self.stop(kind, reason)
        self.release()
        return failure

    def stop(self, kind: FailureKind = FailureKind.CANCELLED,
             reason: str = "the prefill side aborted the transfer") -> TransferFailed:
        """Stop the transfer before its next gather (no END will be sent); its blocks stay pinned until
        release(). Waits for no engine lock. Idempotent; a transfer that already completed stays DONE.
        Returns why it ended."""
        if self.state is TransferState.DONE:
            return TransferFailed(kind, f"{reason} (after it had completed)")
        with self._pin_lock:
            if self._aborted is None:
                self._aborted = TransferFailed(kind, reason)
        self._queue.put(_WAKE)
        return self._aborted

    def release(self) -> None:
        """Let go of every block this transfer pinned (they stay cached by hash). Idempotent."""
        with self._pin_lock:
            pinned, self._pinned = self._pinned, []
        if pinned:
            self.engine.handoff.unpin(pinned)

    @property
    def pinned_blocks(self) -> int:
        return len(self._pinned)

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
            # NOTE: where this end gave up, its own reason wins over how the channel saw the stream end
            self._error, self.state = self._gave_up or e, TransferState.FAILED
        except Exception as e:  # a transport bug must still end the transfer cleanly
            self._error = self._gave_up or TransferFailed(FailureKind.INTERNAL, f"{type(e).__name__}: {e}")
            self.state = TransferState.FAILED
        finally:
            if self.staged is not None:  # an aborted stream's slots (a slot whose copy runs stays busy)
                self.staged.ring.release_all(self.begin.transfer_id)

    def _frames(self) -> Iterator[Frame]:
        yield self.begin.encode(), b""
        while True:
            work = self._queue.get()
            self._raise_if_aborted()
            if work is _WAKE:
                continue
            if work is _END:
                yield TransferEnd(self.begin.transfer_id, self._total_blocks, self.bytes_sent).encode(), b""
                return
            yield from self._layer_frames(work)

    def _layer_frames(self, work: _LayerWork) -> Iterator[Frame]:
        """One LAYER frame per chunk of blocks, gathered lazily, each gather after an abort check."""
        frames = encode_layer(self.engine.kv_cache, work.layer, work.block_ids, work.positions,
                              self.begin.transfer_id, self.max_chunk_bytes, staged=self.staged,
                              after=work.ready)
        with closing(frames):  # NOTE: an abort closes it at once, so it releases its staging slot
            while True:
                self._raise_if_aborted()
                try:
                    frame = next(frames, None)
                except StagingTimeout as e:  # the device or the wire is not keeping up: busy, retry later
                    self._gave_up = TransferFailed(FailureKind.RESOURCE_EXHAUSTED, f"the sender's {e}")
                    raise self._gave_up from e
                if frame is None:
                    return
                self.bytes_sent += len(frame[1])
                yield frame

    def _raise_if_aborted(self) -> None:
        if self._aborted is not None:
            raise self._aborted


class LayerwiseSender:
    """The prefill engine's step observer: routes each written layer to the transfers it feeds,
    and aborts a transfer whose request is preempted."""

    def __init__(self, engine: LLMEngine, layout: KVLayout,
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, staged: StagedCopies | None = None) -> None:
        """staged: the transfers' staging (pdserve/transfer/staging.py); by default a device pool's
        own, none for a CPU pool."""
        self.engine, self.layout, self.max_chunk_bytes = engine, layout, max_chunk_bytes
        self.staged = staged or staging_for_pool(engine.kv_cache, max(max_chunk_bytes, layout.block_bytes))
        self._transfers: dict[str, OutgoingTransfer] = {}
        self._lock = threading.Lock()

    def start(self, request_id: str, prompt_token_ids: list[int], decode_cached_blocks: int,
              channel: KVChannel, timeout_s: float, cache_salt: bytes = b"") -> OutgoingTransfer:
        total = ceil_div(len(prompt_token_ids), self.layout.block_size)
        begin = TransferBegin(uuid.uuid4().hex, request_id, self.layout, tuple(prompt_token_ids),
                              len(prompt_token_ids), decode_cached_blocks,
                              tuple(range(decode_cached_blocks, total)), cache_salt=cache_salt)
        transfer = OutgoingTransfer(self.engine, self.layout, begin, channel, timeout_s, self.max_chunk_bytes,
                                    self.staged)
        with self._lock:
            self._transfers[request_id] = transfer
        transfer.start()
        return transfer

    def finish(self, request_id: str) -> None:
        """Forget the request's transfer and let go of its blocks (call once it has ended)."""
        with self._lock:
            transfer = self._transfers.pop(request_id, None)
        if transfer is not None:
            transfer.release()

    def pinned_blocks(self) -> int:
        """Block references held by transfers under way (a block sent by two counts twice)."""
        with self._lock:
            return sum(t.pinned_blocks for t in self._transfers.values())

    # --- StepObserver (pdserve/engine/llm_engine.py): the engine's thread, its lock held ---------
    def layer_done(self, layer: int, chunks: list[ScheduledChunk]) -> None:
        with self._lock:
            if not self._transfers:
                return
            ready = self._compute_event()
            for chunk in chunks:
                transfer = self._transfers.get(chunk.seq.request_id)
                if transfer is not None:
                    transfer.offer(layer, chunk, ready)

    def _compute_event(self) -> Event | None:
        """An event on the compute stream, after the layer just enqueued; None on a CPU pool."""
        if self.staged is None:
            return None
        event = self.staged.streams.new_event()
        event.record(self.staged.streams.current_stream())
        return event

    def preempted(self, seq: Sequence) -> bool:
        """A request whose KV is being sent lost its blocks: abort the transfer, drop the request."""
        with self._lock:
            transfer = self._transfers.get(seq.request_id)
        if transfer is None:
            return False
        transfer.abort(FailureKind.ABORTED, "preempted: the prefill worker needed its KV blocks for "
                                            "older requests; prefill it elsewhere")
        return True
