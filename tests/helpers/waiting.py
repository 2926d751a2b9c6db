"""Waiting for a condition another thread or process brings about, polling (never a fixed sleep).

    eventually   the condition's value once truthy; AssertionError naming what was awaited after timeout_s
    wait_for     whether the condition came about within timeout_s (for a test that checks it later)
    until_clean  until a mapping of what is left is empty; AssertionError naming what is left
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(condition: Callable[[], T], timeout_s: float = 10.0, what: str = "the condition",
               poll_s: float = 0.02) -> T:
    """condition()'s value once truthy; fails naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(poll_s)


def until_clean(left: Callable[[], dict], timeout_s: float, poll_s: float = 0.02) -> None:
    """Poll left() (what each worker still holds, {} for none) until it is empty; timeout_s=0 checks
    once. AssertionError naming what is left after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        dirty = left()
        if not dirty:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"workers not clean after {timeout_s} s: {dirty}")
        time.sleep(poll_s)


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """True once condition() holds; False if it still does not after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True
