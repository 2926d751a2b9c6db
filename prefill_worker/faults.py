"""Fault injection for KV transfers: a debug hook that is part of the product, off by default.

A prefill worker built with `PrefillConfig(fault_plan=FaultPlan(...))` wraps its outgoing KV
channels in a FaultInjectingChannel; without a plan nothing is wrapped, so the hot path has no
checks. There is no environment variable or flag that turns it on.

    LayerwiseSender --frames--> FaultInjectingChannel --frames--> GrpcKVChannel (or a test's channel)
                                 reads BEGIN's request id, asks the FaultInjector which rule
                                 (if any) hits this transfer, then on the chosen LAYER frame:

    DROP     abort the stream instead of sending it   both ends report CANCELLED
             (over gRPC the client cancels the call, and gRPC logs the raised TransferFailed)
    CORRUPT  flip one byte of its payload, after the  both ends report DATA_LOSS
             sender computed the block checksums
    DELAY    sleep past the push's deadline first     both ends report DEADLINE_EXCEEDED

The plan is frozen configuration; the FaultInjector is its runtime side (transfer count,
seeded random source, counters of what it injected). A transfer is hit by the first rule
whose selector picks it, and at most once. A rule whose frame the stream never reaches
(at_frame past the transfer's last LAYER frame) injects nothing and counts nothing.
"""

from __future__ import annotations

import enum
import itertools
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pdserve.kvwire import LayerChunkHeader, TransferBegin, WireError, decode_header
from pdserve.transfer.channel import Frame, KVChannel, PushResult
from pdserve.transfer.errors import FailureKind, TransferFailed

log = logging.getLogger(__name__)


class FaultKind(enum.Enum):
    DROP = "drop"
    CORRUPT = "corrupt"
    DELAY = "delay"


# How each end of the transfer reports an injected fault (the contract the tests pin).
EXPECTED_FAILURE = {
    FaultKind.DROP: FailureKind.CANCELLED,
    FaultKind.CORRUPT: FailureKind.DATA_LOSS,
    FaultKind.DELAY: FailureKind.DEADLINE_EXCEEDED,
}


# --- selectors: which transfers a rule hits ---------------------------------------------------
@dataclass(frozen=True)
class EveryNth:
    """The n-th, 2n-th, ... transfer this worker sends (counted from 1, over all decode targets)."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"EveryNth.n must be >= 1, got {self.n}")

    def selects(self, ordinal: int, request_id: str, rng: random.Random) -> bool:
        return ordinal % self.n == 0


@dataclass(frozen=True)
class RequestIds:
    """Transfers of these request ids."""

    ids: frozenset[str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", frozenset(self.ids))

    def selects(self, ordinal: int, request_id: str, rng: random.Random) -> bool:
        return request_id in self.ids


@dataclass(frozen=True)
class Matching:
    """Transfers whose request id satisfies the predicate (not picklable if it is a lambda)."""

    predicate: Callable[[str], bool]

    def selects(self, ordinal: int, request_id: str, rng: random.Random) -> bool:
        return bool(self.predicate(request_id))


@dataclass(frozen=True)
class Chance:
    """Each transfer with this probability, drawn from the plan's seeded random source."""

    probability: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"Chance.probability must be in [0, 1], got {self.probability}")

    def selects(self, ordinal: int, request_id: str, rng: random.Random) -> bool:
        return rng.random() < self.probability


Selector = EveryNth | RequestIds | Matching | Chance


@dataclass(frozen=True)
class FaultRule:
    kind: FaultKind
    select: Selector
    at_frame: int = 1  # which LAYER frame of the transfer is hit, 0 = the first
    overshoot_s: float = 0.5  # DELAY: sleep the push's whole timeout plus this

    def __post_init__(self) -> None:
        if self.at_frame < 0:
            raise ValueError(f"at_frame must be >= 0 (0 = the first LAYER frame), got {self.at_frame}")
        if self.overshoot_s <= 0:
            raise ValueError(f"overshoot_s must be > 0 so that a DELAY passes the deadline, "
                             f"got {self.overshoot_s}")


@dataclass(frozen=True)
class FaultPlan:
    rules: tuple[FaultRule, ...]
    seed: int = 0  # for Chance selectors

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        if not self.rules:
            raise ValueError("a FaultPlan needs at least one FaultRule; leave fault_plan=None for none")


# --- runtime --------------------------------------------------------------------------------------
class FaultInjector:
    """Picks the transfers a plan hits and counts what it injected (by FaultKind value)."""

    def __init__(self, plan: FaultPlan, sleep: Callable[[float], None] = time.sleep) -> None:
        self.plan = plan
        self.injected: Counter[str] = Counter()
        self._sleep = sleep
        self._rng = random.Random(plan.seed)
        self._transfers = 0
        self._lock = threading.Lock()
        log.warning("KV transfer fault injection is ON: %s", plan)

    def choose(self, request_id: str) -> FaultRule | None:
        """The rule that hits this (next) transfer, or None; call once per transfer."""
        with self._lock:
            self._transfers += 1
            return next((r for r in self.plan.rules
                         if r.select.selects(self._transfers, request_id, self._rng)), None)

    def wrap(self, channel: KVChannel) -> FaultInjectingChannel:
        return FaultInjectingChannel(channel, self)

    def apply(self, rule: FaultRule, request_id: str, frames: Iterator[Frame],
              timeout_s: float) -> Iterator[Frame]:
        """`frames` with the rule's fault on its chosen LAYER frame."""
        layer_frames = 0
        for frame in frames:
            header, payload = frame
            if layer_frames <= rule.at_frame and isinstance(_decode(header), LayerChunkHeader):
                if layer_frames == rule.at_frame:
                    injected = self._inject(rule, request_id, payload, timeout_s)
                    frame = frame if injected is payload else (header, injected)
                layer_frames += 1
            yield frame  # untouched frames as they came: a PackedFrame keeps its message

    def _inject(self, rule: FaultRule, request_id: str, payload: bytes, timeout_s: float) -> bytes:
        with self._lock:
            self.injected[rule.kind.value] += 1
        where = f"request {request_id}, LAYER frame {rule.at_frame}"
        log.warning("fault injection: %s (%s)", rule.kind.value, where)
        if rule.kind is FaultKind.DROP:
            raise TransferFailed(FailureKind.CANCELLED, f"fault injection dropped the stream ({where})")
        if rule.kind is FaultKind.CORRUPT:
            flipped = bytearray(payload)
            flipped[len(flipped) // 2] ^= 0xFF
            return bytes(flipped)
        self._sleep(timeout_s + rule.overshoot_s)
        return payload


class FaultInjectingChannel:
    """A KVChannel that lets its injector tamper with the frames before `inner` carries them."""

    def __init__(self, inner: KVChannel, injector: FaultInjector) -> None:
        self.inner, self.injector = inner, injector

    def push(self, frames: Iterator[Frame], timeout_s: float) -> PushResult:
        frames = iter(frames)
        first = next(frames, None)
        if first is None:
            return self.inner.push(iter(()), timeout_s)
        begin = _decode(first[0])
        rule = self.injector.choose(begin.request_id) if isinstance(begin, TransferBegin) else None
        if rule is not None:
            frames = self.injector.apply(rule, begin.request_id, frames, timeout_s)
        return self.inner.push(itertools.chain([first], frames), timeout_s)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


def _decode(header: bytes):
    try:
        return decode_header(header)
    except WireError:
        return None  # not ours to judge: the receiver rejects it
