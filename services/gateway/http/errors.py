"""Failures as OpenAI's error JSON, ``{"error": {"message", "type", "param", "code"}}``, with
the HTTP status OpenAI's clients expect (they pick the exception class by status)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass

import grpc
from grpc import aio
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from services.runtime.errors import DomainError, ResourceExhausted
from services.runtime.rpc.interceptors import RETRY_AFTER_HEADER
from services.runtime.sampling.request_validation import InvalidField

log = logging.getLogger("loramesh.gateway.openai")


@dataclass(frozen=True)
class ErrorKind:
    status: int
    type: str


#: gRPC status name (a domain error's or an upstream service's) -> HTTP status and OpenAI type.
KINDS = {
    "INVALID_ARGUMENT": ErrorKind(400, "invalid_request_error"),
    "FAILED_PRECONDITION": ErrorKind(400, "invalid_request_error"),
    "ALREADY_EXISTS": ErrorKind(400, "invalid_request_error"),  # as vLLM's load_lora_adapter
    "OUT_OF_RANGE": ErrorKind(400, "invalid_request_error"),
    "UNAUTHENTICATED": ErrorKind(401, "authentication_error"),
    "PERMISSION_DENIED": ErrorKind(403, "permission_error"),
    "NOT_FOUND": ErrorKind(404, "not_found_error"),
    "RESOURCE_EXHAUSTED": ErrorKind(429, "rate_limit_error"),
    "UNAVAILABLE": ErrorKind(503, "service_unavailable_error"),
    "DEADLINE_EXCEEDED": ErrorKind(503, "service_unavailable_error"),
    "CANCELLED": ErrorKind(503, "service_unavailable_error"),
}
SERVER_ERROR = ErrorKind(500, "server_error")

#: Fields a worker's refusal names as the wire does, and how this API spells them; longest first.
#: (A schema the worker cannot follow is only found out there, when it compiles the grammar.)
UPSTREAM_FIELDS = (
    ("structured_output.json_schema", "response_format.json_schema.schema"),
    ("structured_output", "response_format"),
)


class OpenAIError(Exception):
    """A refusal decided by the HTTP front end itself (bad JSON, an unsupported field...)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class ErrorPayload:
    """A failure in some dialect's JSON (:meth:`json`), sent as a response, with ``Retry-After``
    when the client should come back later, or as an SSE ``error`` event."""

    status: int
    retry_after_s: float | None

    def json(self) -> dict:
        raise NotImplementedError

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"retry-after": str(max(1, math.ceil(self.retry_after_s)))}  # whole seconds, never early

    def response(self) -> JSONResponse:
        return JSONResponse(self.json(), status_code=self.status, headers=self.headers())

    def sse_event(self) -> bytes:
        return f"data: {json.dumps(self.json())}\n\n".encode()


@dataclass(frozen=True)
class ErrorBody(ErrorPayload):
    """One failure as OpenAI's error JSON."""

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None

    def json(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        headers = super().headers()
        if self.retry_after_s is not None:
            # OpenAI's own header, which its clients read before Retry-After: the exact delay.
            headers["retry-after-ms"] = str(max(1, math.ceil(self.retry_after_s * 1000)))
        return headers


def error_body(error: BaseException) -> ErrorBody:
    """What ``error`` says to an OpenAI client."""
    if isinstance(error, OpenAIError):
        kind_type = "invalid_request_error" if error.status < 500 else "server_error"
        return ErrorBody(error.status, error.message, kind_type, error.param, error.code)
    if isinstance(error, DomainError):
        kind = KINDS.get(error.code_name, SERVER_ERROR)
        retry = error.retry_after_s if isinstance(error, ResourceExhausted) else None
        return ErrorBody(
            kind.status,
            error.message,
            kind.type,
            param=error.field if isinstance(error, InvalidField) else None,
            code=error.code_name.lower(),
            retry_after_s=retry,
        )
    if isinstance(error, aio.AioRpcError):
        # Another service's refusal (the store's NOT_FOUND, the scheduler's RESOURCE_EXHAUSTED).
        code = error.code()
        kind = KINDS.get(code.name, SERVER_ERROR)
        retry = next(
            (float(v) for k, v in (error.trailing_metadata() or ()) if k == RETRY_AFTER_HEADER), None
        )
        message = error.details() or code.name
        if code == grpc.StatusCode.UNIMPLEMENTED or kind is SERVER_ERROR:
            log.warning("upstream failure: %s %s", code.name, message)
        param, message = (
            upstream_field(message) if code == grpc.StatusCode.INVALID_ARGUMENT else (None, message)
        )
        return ErrorBody(
            kind.status, message, kind.type, param=param, code=code.name.lower(), retry_after_s=retry
        )
    if isinstance(error, HTTPException):
        return ErrorBody(error.status_code, str(error.detail), "invalid_request_error")
    log.exception("unexpected failure in the OpenAI API", exc_info=error)
    return ErrorBody(500, "internal error; see the gateway's log", "server_error")


def upstream_field(message: str) -> tuple[str | None, str]:
    """``(param, message)`` of an upstream refusal whose message starts with the wire name of a
    field (:data:`UPSTREAM_FIELDS`): the field as this API names it, in the message too."""
    for wire, name in UPSTREAM_FIELDS:
        if message.startswith(wire):
            return name, name + message[len(wire) :]
    return None, message


async def handle_error(request: Request, error: Exception) -> JSONResponse:
    """Starlette exception handler: every failure as OpenAI's error JSON."""
    return error_body(error).response()
