"""``response_format`` on both OpenAI routes, on a real gateway core in front of a scripted
worker: each form reaches the worker as the engine's structured output; a malformed one is a 400
naming the part that is wrong, before anything reaches a worker; a schema only the worker finds
it cannot follow is a 400 naming ``response_format``, streamed or not."""

from __future__ import annotations

import json

import pytest

from mesh_api.v1 import types_pb2

CHAT = {"model": "pirate", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": "pirate", "prompt": "Hi", "max_tokens": 4}
SCHEMA = {
    "type": "object",
    "properties": {"b": {"type": "integer"}, "a": {"enum": ["x", "y"]}},
    "required": ["b"],
}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))  # compact, the properties in their order


@pytest.fixture
def gateway(scripted_gateway):
    scripted_gateway.worker.script = scripted_gateway.core.encode('{"b": 1}')
    return scripted_gateway


FORMS = {
    "text": ({"type": "text"}, None),
    "json_object": ({"type": "json_object"}, types_pb2.StructuredOutput(json_object=True)),
    "json_schema": (
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}},
        types_pb2.StructuredOutput(json_schema=SCHEMA_TEXT),
    ),
    "json_schema, not strict": (
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": False}},
        types_pb2.StructuredOutput(json_schema=SCHEMA_TEXT),
    ),
    "LoRAX's json_object with a schema": (
        {"type": "json_object", "schema": SCHEMA},
        types_pb2.StructuredOutput(json_schema=SCHEMA_TEXT),
    ),
}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("form", FORMS, ids=list(FORMS))
async def test_each_form_reaches_the_worker_as_structured_output(gateway, form, path):
    response_format, expected = FORMS[form]
    body = CHAT if "chat" in path else COMPLETION
    reply = await gateway.http.post(path, json={**body, "response_format": response_format})
    assert reply.status_code == 200, reply.text
    [request] = gateway.worker.requests
    if expected is None:
        assert not request.sampling.HasField("structured_output")
    else:
        assert request.sampling.structured_output == expected


MALFORMED = {
    "no type": ({}, "response_format.type"),
    "an unknown type": ({"type": "yaml"}, "response_format.type"),
    "not an object": ("json", "response_format"),
    "json_schema without json_schema": ({"type": "json_schema"}, "response_format.json_schema"),
    "json_schema without a name": ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
    "a name OpenAI would refuse": (
        {"type": "json_schema", "json_schema": {"name": "my answer", "schema": SCHEMA}},
        "response_format.json_schema.name",
    ),
    "json_schema without a schema": ({"type": "json_schema", "json_schema": {"name": "a"}}, "response_format.json_schema.schema"),
    "a schema that is no object": (
        {"type": "json_schema", "json_schema": {"name": "a", "schema": [SCHEMA]}},
        "response_format.json_schema.schema",
    ),
    "strict that is no boolean": (
        {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": "very"}},
        "response_format.json_schema.strict",
    ),
}  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
async def test_a_malformed_response_format_is_a_400_naming_what_is_wrong(gateway, case, path):
    response_format, param = MALFORMED[case]
    body = CHAT if "chat" in path else COMPLETION
    reply = await gateway.http.post(path, json={**body, "response_format": response_format})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(param)
    assert error["type"] == "invalid_request_error"
    assert gateway.worker.requests == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_schema_the_worker_cannot_follow_is_a_400_naming_response_format(gateway, stream):
    gateway.worker.refusal = (
        "structured_output.json_schema is not a schema loramesh can follow: Invalid type: bogus"
    )
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "bogus"}}}
    reply = await gateway.http.post(
        "/v1/chat/completions", json={**CHAT, "response_format": response_format, "stream": stream}
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"] == {
        "message": "response_format.json_schema.schema is not a schema loramesh can follow: Invalid type: bogus",
        "type": "invalid_request_error",
        "param": "response_format.json_schema.schema",
        "code": "invalid_argument",
    }


async def test_a_worker_refusal_of_the_constraint_itself_names_response_format(gateway):
    gateway.worker.refusal = "structured_output: this worker was started without grammar support"
    reply = await gateway.http.post(
        "/v1/completions", json={**COMPLETION, "response_format": {"type": "json_object"}}
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "response_format"
    assert error["message"] == "response_format: this worker was started without grammar support"
