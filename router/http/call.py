"""One HTTP request run through the same GenerationServicer.Generate that serves gRPC.

No second copy of the request pipeline and no extra gRPC hop: the HTTP handler builds a
GenerateRequest and iterates the servicer's generator on a thread of its own, through
HttpCallContext, which gives the servicer the part of grpc.ServicerContext it uses:

    abort(code, details)        raises CallAborted: the handler answers with the mapped status
    set_trailing_metadata       keeps retry-after-ms for a 429's Retry-After
    add_callback(fn)            runs fn when the HTTP client goes away (cancel() below), which
                                cancels the downstream worker calls: their KV is freed
    is_active                   False after cancel()
    time_remaining              None: no deadline of its own (the servicer's default applies)
    invocation_metadata         the bearer token, for --cache-isolation token

Lifecycle of a call: running -> finished (the generator ended) | aborted (CallAborted) |
cancelled (the client disconnected; cancel() ran the callbacks, the generator ends quietly).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc

from pdserve.security.auth import AUTHORIZATION_KEY


class CallAborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, retry_after_s: float | None) -> None:
        super().__init__(details)
        self.code, self.details, self.retry_after_s = code, details, retry_after_s


class HttpCallContext:
    def __init__(self, bearer_token: str | None = None) -> None:
        self._metadata = ((AUTHORIZATION_KEY, f"Bearer {bearer_token}"),) if bearer_token else ()
        self._callbacks: list[Callable[[], object]] = []
        self._active = True
        self._retry_after_s: float | None = None
        self._lock = threading.Lock()

    # --- what the servicer calls -------------------------------------------------------------
    def abort(self, code: grpc.StatusCode, details: str):
        raise CallAborted(code, details, self._retry_after_s)

    def set_trailing_metadata(self, metadata) -> None:
        for key, value in metadata:
            if key == "retry-after-ms":
                self._retry_after_s = int(value) / 1000

    def add_callback(self, callback: Callable[[], object]) -> bool:
        with self._lock:
            if not self._active:
                return False
            self._callbacks.append(callback)
            return True

    def is_active(self) -> bool:
        return self._active

    def time_remaining(self) -> None:
        return None  # no deadline: the servicer's default applies; a cancel is named CANCELLED

    def invocation_metadata(self):
        return self._metadata

    # --- what the HTTP handler calls -----------------------------------------------------------
    def cancel(self) -> None:
        """The client went away: end the call and cancel what it started downstream."""
        with self._lock:
            if not self._active:
                return
            self._active = False
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

