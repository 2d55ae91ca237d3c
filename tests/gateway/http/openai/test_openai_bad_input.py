"""Raw HTTP against the gateway's OpenAI API on a real mesh: every bad request gets OpenAI's error
JSON with the right status and a message naming what is wrong, and the server keeps serving."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.model]

BASE_MODEL = "SmolLM2-135M-Instruct"
ALICE = {"Authorization": "Bearer key-alice"}


@dataclass(frozen=True)
class BadRequest:
    path: str
    status: int
    message: str
    """A fragment the error message must contain."""
    json: dict | None = None
    content: bytes | None = None
    headers: dict = field(default_factory=lambda: ALICE)
    param: str | None = None
    method: str = "POST"
    path_root: bool = False
    """``path`` is beside ``/v1`` (vLLM's ``/tokenize``...), not under it."""


def completion(**fields) -> dict:
    return {"model": BASE_MODEL, "prompt": "Hello", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": BASE_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


CASES = {
    "malformed JSON": BadRequest("/completions", 400, "not valid JSON", content=b'{"model": "x", '),
    "deeply nested JSON": BadRequest(
        "/completions", 400, "nests too deeply", content=b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    ),
    "not an object": BadRequest("/chat/completions", 400, "JSON object", content=b"[1, 2]"),
    "missing messages": BadRequest("/chat/completions", 400, "messages", json={"model": BASE_MODEL}, param="messages"),
    "unknown model": BadRequest("/completions", 404, "does not exist", json=completion(model="nope"), param="model"),
    "no key": BadRequest("/completions", 401, "missing API key", json=completion(), headers={}),
    "bad key": BadRequest(
        "/chat/completions", 401, "invalid API key", json=chat(), headers={"Authorization": "Bearer wrong"}
    ),
    "another tenant's private adapter, as a missing one": BadRequest(
        "/chat/completions", 404, "'bob/secret' does not exist", json=chat(model="bob/secret"), param="model"
    ),
    "over-long prompt": BadRequest("/completions", 400, "the limit is 4096", json=completion(prompt="word " * 5000)),
    "negative max_tokens": BadRequest("/completions", 400, "max_tokens", json=completion(max_tokens=-5), param="max_tokens"),
    "max_tokens over the limit": BadRequest("/chat/completions", 400, "above the limit", json=chat(max_tokens=100_000)),
    "temperature out of range": BadRequest("/completions", 400, "temperature", json=completion(temperature=500)),
    "tools": BadRequest(
        "/chat/completions", 400, "tools[0].function must be an object with a name",
        json=chat(tools=[{"type": "function"}]), param="tools[0].function",
    ),
    "presence_penalty out of range": BadRequest(
        "/chat/completions", 400, "presence_penalty must be within [-2, 2]", json=chat(presence_penalty=2.5),
        param="presence_penalty",
    ),
    "logit_bias outside the vocabulary": BadRequest(
        "/completions", 400, "logit_bias token ids must be within", json=completion(logit_bias={"99999999": 1}),
        param="logit_bias",
    ),
    "a malformed response_format": BadRequest(
        "/chat/completions", 400, "response_format.json_schema.schema", param="response_format.json_schema.schema",
        json=chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}),
    ),
    "a schema the worker cannot follow": BadRequest(
        "/chat/completions", 400, "Invalid type: bogus", param="response_format.json_schema.schema",
        json=chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "bogus"}}}),
    ),
    "a token id outside the vocabulary": BadRequest(
        "/detokenize", 400, "tokens must be within", json={"model": BASE_MODEL, "tokens": [99999999]}, param="tokens",
        path_root=True,
    ),
    "top_logprobs without logprobs": BadRequest(
        "/chat/completions", 400, "top_logprobs needs logprobs: true", json=chat(top_logprobs=2), param="top_logprobs"
    ),
    "top_logprobs over 20": BadRequest(
        "/chat/completions", 400, "top_logprobs must be within [0, 20]", json=chat(logprobs=True, top_logprobs=21),
        param="top_logprobs",
    ),
    "completion logprobs over 5": BadRequest(
        "/completions", 400, "logprobs must be within [0, 5]", json=completion(logprobs=6), param="logprobs"
    ),
    "bad role": BadRequest(
        "/chat/completions", 400, "messages[0].role", json=chat(messages=[{"role": "wizard", "content": "x"}])
    ),
    "unknown route": BadRequest("/embeddings", 404, "Not Found", json={}),
    "body too large": BadRequest("/completions", 413, "request body is over", content=b" " * (9 * 2**20)),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_request_gets_openai_error_json_and_the_server_keeps_serving(mesh, case: BadRequest):
    with httpx.Client(base_url=mesh.openai_base_url, timeout=120) as http:
        reply = http.request(
            case.method,
            mesh.openai_base_url.removesuffix("/v1") + case.path if case.path_root else case.path,
            json=case.json,
            content=case.content,
            headers={"content-type": "application/json", **case.headers},
        )
        assert reply.status_code == case.status, reply.text
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert case.message in error["message"]
        if case.param is not None:
            assert error["param"] == case.param
        after = http.post("/completions", json=completion(temperature=0), headers=ALICE)
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_stream_is_server_sent_events_ending_with_done(mesh):
    body = completion(stream=True, max_tokens=3, temperature=0)
    with httpx.Client(base_url=mesh.openai_base_url, timeout=120) as http:
        reply = http.post("/completions", json=body, headers=ALICE)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = [line for line in reply.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
