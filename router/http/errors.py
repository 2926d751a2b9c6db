"""OpenAI's error shape, and the HTTP status for each gRPC status the Generation servicer ends with.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

    INVALID_ARGUMENT    400 invalid_request_error   a field out of range (the message names it)
    UNAUTHENTICATED     401 authentication_error     missing or wrong bearer token
    PERMISSION_DENIED   403 permission_error
    (unknown model/path) 404 not_found_error
    RESOURCE_EXHAUSTED  429 rate_limit_error          with Retry-After (whole seconds, at least 1)
    UNAVAILABLE         503 service_unavailable_error no worker can serve
    DEADLINE_EXCEEDED   504 timeout_error
    anything else       500 server_error

Pure: no aiohttp; the server turns an ApiError into a response.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import grpc

_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
# The servicer's messages name gRPC fields; a client of this API wrote the OpenAI ones.
_PARAMS = (("sampling.stop_token_ids", "stop_token_ids"), ("sampling.stop", "stop"),
           ("sampling.logprobs", "logprobs"), ("max_tokens", "max_tokens"), ("temperature", "temperature"),
           ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "seed"), ("prompt", "prompt"),
           ("chat.messages", "messages"), ("chat has", "messages"), ("request_id", "request_id"),
           ("chat_template_kwargs", "chat_template_kwargs"))


@dataclass(eq=False)  # NOTE: not frozen: raising sets __traceback__, which a frozen dataclass refuses
class ApiError(Exception):
    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None  # 429: sent as Retry-After

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    @classmethod
    def invalid(cls, message: str, param: str | None) -> ApiError:
        return cls(400, message, "invalid_request_error", param)

    @classmethod
    def model_not_found(cls, asked: object, served: str) -> ApiError:
        return cls(404, f"model {asked!r} does not exist here; this server serves {served!r} "
                   "(GET /v1/models)", "not_found_error", "model", "model_not_found")

    @classmethod
    def unauthorized(cls, message: str) -> ApiError:
        return cls(401, message, "authentication_error", None, "invalid_api_key")

    @classmethod
    def from_status(cls, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> ApiError:
        status, kind = _BY_CODE.get(code, (500, "server_error"))
        retry = retry_after_s if status == 429 else None
        if status == 429 and retry is None:
            retry = 1.0
        param = _param_of(message) if status == 400 else None
        return cls(status, message, kind, param, code.name.lower(), retry)


def _param_of(message: str) -> str | None:
    """The OpenAI field a servicer message is about, when it starts by naming one."""
    for prefix, param in _PARAMS:
        if re.match(rf"(a )?{re.escape(prefix)}\b", message):
            return param
    return None
