"""Every failure becomes OpenAI's error JSON with the status OpenAI's clients expect."""

from __future__ import annotations

import json

import grpc
import pytest
from grpc import aio

from services.gateway.http.errors import OpenAIError, error_body
from services.runtime.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (InvalidArgument("prompt is empty"), 400, "invalid_request_error"),
        (AlreadyExists("adapter 'x' already exists"), 400, "invalid_request_error"),
        (Unauthenticated("invalid API key"), 401, "authentication_error"),
        (PermissionDenied("adapter 'bob/x' is private"), 403, "permission_error"),
        (NotFound("no adapter 'x'"), 404, "not_found_error"),
        (ResourceExhausted("every queue is full"), 429, "rate_limit_error"),
        (Unavailable("no live worker"), 503, "service_unavailable_error"),
        (OpenAIError(400, "n must be within [1, 16]", "n"), 400, "invalid_request_error"),
        (RuntimeError("a bug"), 500, "server_error"),
    ],
)
def test_status_and_type(error, status, kind):
    body = error_body(error)
    assert (body.status, body.type) == (status, kind)
    payload = json.loads(body.response().body)
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    if status < 500:
        assert payload["error"]["message"] == str(error)
    else:
        assert "a bug" not in payload["error"]["message"]  # internals stay in the log


def test_a_retry_hint_becomes_retry_after():
    response = error_body(ResourceExhausted("every queue is full", retry_after_s=1.4)).response()
    assert response.status_code == 429 and response.headers["retry-after"] == "2"


def test_an_upstream_refusal_keeps_its_status_message_and_retry_hint():
    upstream = aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        aio.Metadata(),
        aio.Metadata(("retry-after-s", "2.600")),
        details="no worker can meet the first-token deadline",
    )
    body = error_body(upstream)
    assert (body.status, body.message, body.retry_after_s) == (
        429,
        "no worker can meet the first-token deadline",
        2.6,
    )
    assert body.response().headers["retry-after"] == "3"


def test_an_error_event_for_a_stream_that_already_started():
    event = error_body(Unavailable("request failed on 4 workers")).sse_event()
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[len(b"data: ") :])["error"]["type"] == "service_unavailable_error"
