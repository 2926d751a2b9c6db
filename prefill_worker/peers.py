"""Which decode workers a prefill worker may push KV to: the live ones in the registry.

A Prefill call names its decode target. A worker that dialled whatever address it was given
would carry the cluster secret and the prompt's KV wherever a caller pointed it, so a target
must be the address of a live decode worker in the registry:

    allows(address): in the set last read from the registry -> yes
                     not in it, and that set is older than min_refresh_s -> read again, decide
                     the registry does not answer -> the last set read stands (an address it
                     never listed stays refused: the router then prefills on the decode worker)

The registry is read at most once per min_refresh_s, however many Prefill calls name an
unknown address. Pure logic over the `live_workers` callable; the clock is a parameter.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

log = logging.getLogger(__name__)


class _Registered(Protocol):
    role: str
    address: str


class DecodeTargets(Protocol):
    def allows(self, address: str) -> bool: ...


class AnyDecodeTarget:
    """A worker with no registry (built directly, as tests and benchmarks do): any address."""

    def allows(self, address: str) -> bool:
        return True


class RegisteredDecodeTargets:
    def __init__(self, live_workers: Callable[[], Sequence[_Registered]], min_refresh_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._live_workers, self._min_refresh_s, self._clock = live_workers, min_refresh_s, clock
        self._addresses: frozenset[str] = frozenset()
        self._read_at: float | None = None
        self._lock = threading.Lock()

    def allows(self, address: str) -> bool:
        if address in self._addresses:
            return True
        with self._lock:
            now = self._clock()
            if self._read_at is None or now - self._read_at >= self._min_refresh_s:
                self._read_at = now
                self._refresh()
            return address in self._addresses

    def _refresh(self) -> None:
        try:
            workers = self._live_workers()
        except Exception as e:  # the registry is down: keep the last set read
            log.warning("cannot read the decode workers from the registry (keeping %d known): %s",
                        len(self._addresses), e)
            return
        self._addresses = frozenset(w.address for w in workers if w.role == "decode")
