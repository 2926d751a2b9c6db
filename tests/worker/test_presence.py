"""Presence: the heartbeat thread outlives every error, and a lapsed lease asks for a resync.

Before (seen, in tests/worker/test_redis_faults.py): a Redis error other than a connection error
(OOM, READONLY, NOPERM) escaped heartbeat() and ended the thread, so a healthy worker dropped out
of routing for good.
"""

from __future__ import annotations

import threading

from pdserve.index.base import Lease, StoreUnavailable, WorkerKey
from pdserve.index.breaker import CircuitBreaker
from pdserve.index.memory import InMemoryPrefixIndex
from pdserve.index.publisher import IndexPublisher
from pdserve.worker.presence import Presence
from tests.helpers.workers import worker_record

INFO = worker_record("d0", "decode", "127.0.0.1:1", epoch=7, fingerprint="fp", node="node")


class ScriptedRegistry:
    """Answers heartbeats from a script of outcomes (a unit-test fake of WorkerRegistry)."""

    def __init__(self, outcomes: list) -> None:
        self.outcomes = outcomes
        self.beats = 0
        self.done = threading.Event()

    def register(self, info, ttl_s):
        return Lease.STARTED

    def heartbeat(self, info, ttl_s, load=None):
        self.beats += 1
        outcome = self.outcomes.pop(0) if self.outcomes else Lease.RENEWED
        if not self.outcomes:
            self.done.set()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def deregister(self, worker_id):
        return None


def test_the_heartbeat_thread_survives_every_error_and_resyncs_after_a_lapse():
    registry = ScriptedRegistry([StoreUnavailable("Redis refused the lease: OOM"), RuntimeError("a bug"),
                                 Lease.STARTED, Lease.RENEWED])
    publisher = IndexPublisher(InMemoryPrefixIndex(clock=lambda: 0.0), WorkerKey("d0", 7))
    presence = Presence(registry, publisher, INFO, lambda: {}, heartbeat_s=0.01, ttl_s=1.0,
                        breaker=CircuitBreaker(open_s=0.0))
    presence.start()
    try:
        assert registry.done.wait(5)
        assert presence._thread.is_alive() and not presence.superseded
        assert not publisher.in_sync  # STARTED: the store lost our lease, so it may have lost our entries
    finally:
        presence.stop()
    assert not presence._thread.is_alive()


def test_a_superseded_worker_stops_beating_and_publishing():
    registry = ScriptedRegistry([Lease.SUPERSEDED])
    publisher = IndexPublisher(InMemoryPrefixIndex(clock=lambda: 0.0), WorkerKey("d0", 7))
    publisher.start(list)
    presence = Presence(registry, publisher, INFO, lambda: {}, heartbeat_s=0.01, ttl_s=1.0)
    presence.start()
    try:
        assert registry.done.wait(5)
        deadline_beats = registry.beats
        threading.Event().wait(0.1)
        assert presence.superseded and registry.beats == deadline_beats
        assert not publisher._thread.is_alive()
    finally:
        presence.stop()
