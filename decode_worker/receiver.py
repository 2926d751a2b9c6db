"""The receiving end: verifies and writes one transfer into the decode engine's pool.

Lifecycle of one incoming transfer (TransferState):

    PENDING       BEGIN read; layout checked against ours (nothing reserved yet)
    TRANSFERRING  blocks reserved for the whole prompt; LAYER frames verified and written
    DONE          END matched every (layer, block) pair: the engine parks the KV for Decode
    FAILED        any error, disconnect, deadline or cancel: the reservation is freed at
                  once and TransferFailed says why; the caller recomputes the prompt

Fail closed: a block is written only after its checksum verifies, and a sequence is
usable only after every block of every layer has arrived.

A device pool (pdserve/transfer/staging.py; a CPU pool takes none of this): the load stream first
waits for the compute enqueued so far (the fresh blocks' last readers), each verified frame is copied
host -> device on it without waiting, and one event recorded after the transfer's last frame is
waited on (this thread only) before the KV is parked: park commits the blocks to the prefix cache,
the first point where anything but this receiver can read them. A transfer that fails waits for the
same event before its blocks are freed, so no copy lands in a block that has another owner.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.engine.block_pool import NoFreeBlocksError
from pdserve.engine.handoff import Reservation, TransferRejected
from pdserve.engine.llm_engine import InvalidRequestError, LLMEngine
from pdserve.kvwire import (
    ChecksumError,
    KVLayout,
    LayerChunkHeader,
    TransferBegin,
    TransferEnd,
    WireError,
    decode_header,
    receive_layer,
)
from pdserve.transfer.channel import TransferState
from pdserve.transfer.errors import FailureKind, TransferFailed
from pdserve.transfer.frames import DEFAULT_MAX_CHUNK_BYTES
from pdserve.transfer.staging import StagedCopies, StagingTimeout, staging_for_pool
from pdserve.units import ceil_div


@dataclass(frozen=True)
class ReceiveReport:
    transfer_id: str
    request_id: str
    blocks_written: int  # (layer, block) pairs
    bytes_received: int


class KVReceiver:
    """Accepts transfers for one engine; safe to call from many gRPC threads at once."""

    def __init__(self, engine: LLMEngine, layout: KVLayout, parked_ttl_s: float = 30.0,
                 staged: StagedCopies | None = None) -> None:
        """staged: the load path (pdserve/transfer/staging.py); by default a device pool's own, none
        for a CPU pool. A frame larger than its slots goes through them a slot at a time."""
        self.engine = engine
        self.layout = layout
        self.parked_ttl_s = parked_ttl_s
        self.staged = staged or staging_for_pool(engine.kv_cache,
                                                 max(DEFAULT_MAX_CHUNK_BYTES, layout.block_bytes))
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()  # "done" or a FailureKind value
        self.bytes_received = 0

    def receive(self, frames: Iterable[tuple[bytes, bytes]]) -> ReceiveReport:
        """Consume one transfer's frames; TransferFailed (after freeing everything) on any failure."""
        try:
            report = self._receive(iter(frames))
        except TransferFailed as e:
            self._count(e.kind.value)
            raise
        self._count(TransferState.DONE.value, report.bytes_received)
        return report

    def _count(self, outcome: str, nbytes: int = 0) -> None:
        with self._lock:
            self.outcomes[outcome] += 1
            self.bytes_received += nbytes

    def _receive(self, frames) -> ReceiveReport:
        begin = self._read_begin(frames)
        reservation = self._reserve(begin)
        if self.staged is not None:
            self.staged.after_compute()
        try:
            report = _LayerWriter(self.engine, self.layout, begin, reservation, self.staged).consume(frames)
            self._wait_for_loads()
        except BaseException:
            self._release_after_loads(reservation)
            raise
        self.engine.handoff.park(reservation)
        return report

    def _wait_for_loads(self) -> None:
        """Every host -> device copy enqueued so far has landed (this transfer's among them)."""
        if self.staged is None:
            return
        try:
            self.staged.record().synchronize()
        except Exception as e:  # a copy on the load stream failed: its blocks hold no verified KV
            raise TransferFailed(FailureKind.INTERNAL, f"loading the KV into the pool failed: {e}") from e

    def _release_after_loads(self, reservation: Reservation) -> None:
        try:
            self._wait_for_loads()
        except TransferFailed:
            pass  # NOTE: the transfer has failed already, with its own reason; the blocks go anyway
        finally:
            self.engine.handoff.release(reservation)

    def _read_begin(self, frames) -> TransferBegin:
        header, _ = _next_frame(frames, "before BEGIN")
        begin = _decode(header)
        if not isinstance(begin, TransferBegin):
            raise TransferFailed(FailureKind.INVALID_ARGUMENT, "the first frame must be BEGIN")
        mismatch = begin.layout.first_mismatch(self.layout)  # the sender's first, as the message names them
        if mismatch is not None:
            raise TransferFailed(FailureKind.FAILED_PRECONDITION, f"KV layout mismatch: {mismatch}")
        _check_begin(begin, self.layout.block_size)
        return begin

    def _reserve(self, begin: TransferBegin) -> Reservation:
        try:
            return self.engine.handoff.reserve(begin.request_id, list(begin.prompt_token_ids),
                                               begin.decode_cached_blocks, ttl_s=self.parked_ttl_s,
                                               cache_salt=begin.cache_salt)
        except TransferRejected as e:
            raise TransferFailed(FailureKind.FAILED_PRECONDITION, str(e)) from e
        except NoFreeBlocksError as e:
            raise TransferFailed(FailureKind.RESOURCE_EXHAUSTED,
                                 f"decode pool cannot hold the prompt's KV ({e}); retry later") from e
        except InvalidRequestError as e:
            raise TransferFailed(FailureKind.INVALID_ARGUMENT, str(e)) from e


def _check_begin(begin: TransferBegin, block_size: int) -> None:
    if begin.num_tokens != len(begin.prompt_token_ids):
        raise TransferFailed(FailureKind.INVALID_ARGUMENT,
                             f"num_tokens {begin.num_tokens} != {len(begin.prompt_token_ids)} prompt tokens")
    total = ceil_div(begin.num_tokens, block_size)
    expected = tuple(range(begin.decode_cached_blocks, total))
    if begin.positions != expected:
        raise TransferFailed(FailureKind.INVALID_ARGUMENT,
                             f"positions must be blocks {begin.decode_cached_blocks}..{total - 1} "
                             f"(everything past the receiver's cached prefix)")


class _LayerWriter:
    """Writes verified LAYER frames of one transfer into its reservation until END."""

    def __init__(self, engine: LLMEngine, layout: KVLayout, begin: TransferBegin,
                 reservation: Reservation, staged: StagedCopies | None = None) -> None:
        self.engine, self.layout, self.begin, self.reservation = engine, layout, begin, reservation
        self.staged = staged
        self.missing = {(layer, p) for layer in range(layout.num_layers) for p in begin.positions}
        self.written = 0
        self.nbytes = 0

    def consume(self, frames) -> ReceiveReport:
        while True:
            header, payload = _next_frame(frames, f"with {len(self.missing)} blocks still missing")
            frame = _decode(header)
            if isinstance(frame, LayerChunkHeader):
                self._write(frame, payload)
            elif isinstance(frame, TransferEnd):
                return self._finish(frame)
            else:
                raise TransferFailed(FailureKind.INVALID_ARGUMENT, "a second BEGIN inside one transfer")

    def _write(self, frame: LayerChunkHeader, payload: bytes) -> None:
        keys = {(frame.layer, p) for p in frame.positions}
        if frame.transfer_id != self.begin.transfer_id or not keys <= self.missing:
            raise TransferFailed(FailureKind.INVALID_ARGUMENT,
                                 f"layer {frame.layer} frame carries blocks {list(frame.positions)} "
                                 "that were not announced or were already received")
        block_ids = [self.reservation.block_ids[p] for p in frame.positions]
        try:
            receive_layer(self.engine.kv_cache, frame, payload, self.layout, block_ids, staged=self.staged)
        except ChecksumError as e:
            raise TransferFailed(FailureKind.DATA_LOSS, str(e)) from e
        except WireError as e:
            raise TransferFailed(FailureKind.INVALID_ARGUMENT, str(e)) from e
        except StagingTimeout as e:  # the load stream is not keeping up: this worker is busy, retry later
            raise TransferFailed(FailureKind.RESOURCE_EXHAUSTED, str(e)) from e
        self.missing -= keys
        self.written += len(keys)
        self.nbytes += len(payload)

    def _finish(self, end: TransferEnd) -> ReceiveReport:
        if self.missing or end.total_blocks != self.written or end.total_bytes != self.nbytes:
            raise TransferFailed(FailureKind.INVALID_ARGUMENT,
                                 f"END says {end.total_blocks} blocks / {end.total_bytes} bytes, received "
                                 f"{self.written} / {self.nbytes} with {len(self.missing)} missing")
        return ReceiveReport(self.begin.transfer_id, self.begin.request_id, self.written, self.nbytes)


def _next_frame(frames, where: str) -> tuple[bytes, bytes]:
    try:
        return next(frames)
    except StopIteration:
        raise TransferFailed(FailureKind.CANCELLED, f"sender stream ended {where}") from None
    except TransferFailed:
        raise
    except Exception as e:  # the transport's own error: disconnect, deadline, cancel
        kind = getattr(e, "failure_kind", FailureKind.CANCELLED)
        raise TransferFailed(kind, f"sender stream broke {where}: {e}") from e


def _decode(header: bytes):
    try:
        return decode_header(header)
    except WireError as e:
        raise TransferFailed(FailureKind.INVALID_ARGUMENT, str(e)) from e
