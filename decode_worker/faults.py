"""A debug hook of the decode worker: part of the product, off by default (no flag or environment
variable turns it on; a test or benchmark builds the role with it).

A decode worker built with `DecodeConfig(fault_plan=DecodeFaultPlan(hold_after_tokens=N))` holds
each Decode stream once it has sent N tokens, until release(). Only the sending waits: the engine
goes on decoding the request and its outputs queue. So a test can wait until the streams it cares
about are held (wait_held), then kill, stop or drain the worker, and each stream breaks (or
finishes) at a known point, with no sleeps: the router's migration (router/service.py) and the
drain (pdserve/worker/server.py) are tested this way.

A stream's life under the hold:

    sending --N tokens sent--> HELD --release()--> sending --last token--> done
                                 └--its call ends (the worker stops, the client cancels)--> gone

Without a plan the DecodeServicer gets NO_HOLD, which never waits.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class DecodeFaultPlan:
    hold_after_tokens: int  # every Decode stream waits for release() once it has sent this many

    def __post_init__(self) -> None:
        if self.hold_after_tokens < 1:
            raise ValueError(f"hold_after_tokens must be >= 1, got {self.hold_after_tokens}")


class StreamHold:
    """The runtime side of a plan: which streams reached the hold, and the release."""

    def __init__(self, plan: DecodeFaultPlan) -> None:
        self.after_tokens = plan.hold_after_tokens
        self._cond = threading.Condition()
        self._released = False
        self._reached: list[str] = []  # request ids, in the order they were held

    def before_reply(self, request_id: str, sent_tokens: int, context: grpc.ServicerContext) -> None:
        """Called before each reply with the tokens sent so far: waits while this stream is held."""
        if sent_tokens != self.after_tokens:
            return
        with self._cond:
            if self._released:
                return
            self._reached.append(request_id)
            self._cond.notify_all()
        if not context.add_callback(self._wake):  # the call is over already
            return
        with self._cond:
            self._cond.wait_for(lambda: self._released or not context.is_active())

    def wait_held(self, count: int, timeout_s: float) -> list[str]:
        """The request ids held so far, once there are `count`; TimeoutError naming how many were."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._reached) >= count, timeout_s):
                raise TimeoutError(f"{len(self._reached)} of {count} streams reached the hold after "
                                   f"{self.after_tokens} tokens within {timeout_s} s")
            return list(self._reached)

    def release(self) -> None:
        with self._cond:
            self._released = True
            self._cond.notify_all()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


class _NoHold:
    def before_reply(self, request_id: str, sent_tokens: int, context: grpc.ServicerContext) -> None:
        return None


NO_HOLD = _NoHold()
