"""Streams and events: how the KV path orders copies against compute without stalling either.

A stream runs the work enqueued on it in order; an event recorded on a stream completes once the
stream has run everything enqueued before it. Two implementations of one interface:

    CudaStreams  torch.cuda streams and events; page-locked host memory; copies non_blocking.
                 Nothing touches CUDA until a method is called, so it imports and constructs on a
                 machine without a GPU.
    CpuStreams   the same semantics with threads, so the KV path's ordering logic runs (and is
                 tested) on the CPU: each new stream is one worker thread running its queue in order;
                 the current stream (compute) runs work inline, so its work and events are done as
                 soon as they are enqueued.

Lifecycle of an event: UNRECORDED (query() is True, as on CUDA) -> record(stream) -> PENDING ->
COMPLETE once the stream reaches it. Stream.wait_event(e) holds the stream's later work until e is
COMPLETE; synchronize() holds the calling thread.

Stream.submit(fn) is the seam everything else uses: on CUDA, fn runs now with the stream current,
so the kernels it launches are ordered on that stream; on the CPU, fn runs on the stream's thread in
its turn. Tests hold a CpuStreams stream deterministically by submitting a callable that waits on a
threading.Event gate.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch


class Event(Protocol):
    def record(self, stream: Stream) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Stream(Protocol):
    def submit(self, work: Callable[[], Any]) -> None: ...

    def wait_event(self, event: Event) -> None: ...


class DeviceStreams(Protocol):
    def new_stream(self) -> Stream: ...

    def current_stream(self) -> Stream: ...

    def new_event(self) -> Event: ...

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None: ...


class StreamError(RuntimeError):
    """Work enqueued on a CPU stream raised; events recorded after it re-raise it on synchronize()."""


def streams_for(device: torch.device | str) -> DeviceStreams:
    """CudaStreams for a CUDA device, CpuStreams for anything else."""
    device = torch.device(device)
    return CudaStreams(device) if device.type == "cuda" else CpuStreams()


# --- CUDA ------------------------------------------------------------------------------------------
class _CudaStream:
    def __init__(self, raw: torch.cuda.Stream) -> None:
        self.raw = raw

    def submit(self, work: Callable[[], Any]) -> None:
        with torch.cuda.stream(self.raw):
            work()

    def wait_event(self, event: Event) -> None:
        self.raw.wait_event(event.raw)  # type: ignore[attr-defined]


class _CudaEvent:
    def __init__(self) -> None:
        self.raw = torch.cuda.Event()

    def record(self, stream: Stream) -> None:
        self.raw.record(stream.raw)  # type: ignore[attr-defined]

    def query(self) -> bool:
        return self.raw.query()

    def synchronize(self) -> None:
        self.raw.synchronize()


class CudaStreams:
    """torch.cuda streams on one device."""

    def __init__(self, device: torch.device | str = "cuda") -> None:
        self.device = torch.device(device)

    def new_stream(self) -> Stream:
        return _CudaStream(torch.cuda.Stream(self.device))

    def current_stream(self) -> Stream:
        return _CudaStream(torch.cuda.current_stream(self.device))

    def new_event(self) -> Event:
        return _CudaEvent()

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # NOTE: page-locked, so a copy between it and the device is a DMA that does not hold the host.
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        stream.submit(lambda: dst.copy_(src, non_blocking=True))


# --- CPU -------------------------------------------------------------------------------------------
class _CpuEvent:
    def __init__(self) -> None:
        self._done = threading.Event()
        self._done.set()  # UNRECORDED queries complete, as a CUDA event does
        self._error: BaseException | None = None

    def record(self, stream: Stream) -> None:
        self._done.clear()
        stream._reach(self)  # type: ignore[attr-defined]

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self._error is not None:
            failed = self._error
            raise StreamError(f"work on the stream before this event failed: {failed!r}") from failed

    def _complete(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()


class InlineStream:
    """The current (compute) stream on the CPU: work runs in the caller, before submit returns."""

    def submit(self, work: Callable[[], Any]) -> None:
        work()

    def wait_event(self, event: Event) -> None:
        event.synchronize()

    def _reach(self, event: _CpuEvent) -> None:
        event._complete(None)


_CLOSE = object()


class CpuStream:
    """One worker thread running its queue in order. An error in one work item is kept and raised by
    every event recorded after it; the stream goes on with later work (as a real device would not,
    but a test must be able to see it)."""

    def __init__(self, name: str = "cpu-stream") -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], Any]) -> None:
        self._queue.put(work)

    def wait_event(self, event: Event) -> None:
        self.submit(event.synchronize)

    def close(self) -> None:
        """Finish the work already enqueued, then end the thread."""
        self._queue.put(_CLOSE)
        self._thread.join()

    def _reach(self, event: _CpuEvent) -> None:
        self.submit(lambda: event._complete(self._error))

    def _run(self) -> None:
        while (work := self._queue.get()) is not _CLOSE:
            try:
                work()
            except BaseException as e:  # kept for the events after it; the thread must go on
                self._error = self._error or e


class CpuStreams:
    """Streams as threads: the ordering semantics of CudaStreams, on the CPU."""

    _inline = InlineStream()

    def new_stream(self) -> Stream:
        return CpuStream()

    def current_stream(self) -> Stream:
        return self._inline

    def new_event(self) -> Event:
        return _CpuEvent()

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        stream.submit(lambda: dst.copy_(src))
