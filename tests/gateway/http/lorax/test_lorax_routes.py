"""LoRAX's REST API (``/generate``, ``/generate_stream``, ``/``) on a real gateway core in front
of a scripted worker: LoRAX's response shapes, token by token; its parameters (penalties and
``response_format`` included) mapped onto the engine's sampling; every parameter loramesh cannot
honour refused naming it, in LoRAX's error shape, before anything reaches a worker."""

from __future__ import annotations

import json

import httpx
import pytest

from mesh_api.v1 import types_pb2

BASE = {"inputs": "Say hello:"}
#: The last character is three tokens, the first two of which complete no character.
TEXT = " Hello world, 漢"


@pytest.fixture
def gateway(scripted_gateway):
    tokenizer = scripted_gateway.core.tokenizer
    scripted_gateway.worker.script = [*tokenizer.encode(TEXT), *tokenizer.eos_token_ids]
    return scripted_gateway


def events(reply: httpx.Response) -> list[dict]:
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/event-stream")
    return [json.loads(line[len("data:") :]) for line in reply.text.splitlines() if line.startswith("data:")]


def sampling(gateway):
    [request] = gateway.worker.requests
    return request.sampling


async def test_generate_answers_the_text_and_each_token_with_details(gateway):
    reply = await gateway.http.post("/generate", json={**BASE, "parameters": {"details": True}})
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    details = answer["details"]
    tokens = details["tokens"]
    assert answer["generated_text"] == TEXT
    assert [t["id"] for t in tokens] == gateway.worker.script
    assert "".join(t["text"] for t in tokens) == TEXT
    assert [t["text"] for t in tokens[-4:-1]] == [" ", "", "漢"]  # part of a character adds no text
    assert tokens[-1] == {
        "id": gateway.worker.script[-1],
        "text": "",
        "logprob": -len(tokens),
        "special": True,
    }
    assert not any(t["special"] for t in tokens[:-1])
    assert [t["logprob"] for t in tokens] == [-1.0 - i for i in range(len(tokens))]
    assert details["finish_reason"] == "eos_token"
    assert details["generated_tokens"] == len(tokens)
    assert details["prompt_tokens"] == len(gateway.core.encode(BASE["inputs"]))
    assert details["prefill"] == [] and details["seed"] is None
    without = (await gateway.http.post("/generate", json=BASE)).json()
    assert without == {"generated_text": TEXT}  # no details unless asked for, as LoRAX


async def test_generate_stream_sends_a_token_per_event_and_the_whole_text_last(gateway):
    stream = events(
        await gateway.http.post("/generate_stream", json={**BASE, "parameters": {"details": True}})
    )
    assert [e["token"]["id"] for e in stream] == gateway.worker.script
    assert "".join(e["token"]["text"] for e in stream if not e["token"]["special"]) == TEXT
    assert all(e["generated_text"] is None and e["details"] is None for e in stream[:-1])
    assert stream[-1]["generated_text"] == TEXT and stream[-1]["token"]["special"]
    assert stream[-1]["details"] == {
        "finish_reason": "eos_token",
        "prompt_tokens": len(gateway.core.encode(BASE["inputs"])),
        "generated_tokens": len(stream),
        "seed": None,
        "adapter_version": None,  # the base model's
    }
    plain = events(await gateway.http.post("/generate_stream", json=BASE))
    assert plain[-1]["details"] is None and plain[-1]["generated_text"] == TEXT


async def test_the_compat_route_answers_a_one_element_list_or_the_stream(gateway):
    whole = await gateway.http.post("/", json=BASE)
    assert whole.status_code == 200 and whole.json() == [{"generated_text": TEXT}]
    stream = events(await gateway.http.post("/", json={**BASE, "stream": True}))
    assert stream[-1]["generated_text"] == TEXT


@pytest.mark.parametrize(
    ("parameters", "text", "reason"),
    [
        ({"max_new_tokens": 2}, " Hello world", "length"),
        ({"stop": [" world"]}, " Hello", "stop_sequence"),
    ],
)
async def test_finish_reasons(gateway, parameters, text, reason):
    answer = await gateway.http.post(
        "/generate", json={**BASE, "parameters": {**parameters, "details": True}}
    )
    assert answer.json()["generated_text"] == text
    assert answer.json()["details"]["finish_reason"] == reason
    stream = events(await gateway.http.post("/generate_stream", json={**BASE, "parameters": parameters}))
    assert stream[-1]["generated_text"] == text
    assert "".join(e["token"]["text"] for e in stream) == text


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ({}, {"temperature": 0.0, "max_tokens": 128, "top_logprobs": 0}),  # greedy, the default length
        ({"temperature": 1.0, "top_p": 1.0}, {"temperature": 0.0}),  # nothing reshaped: still greedy
        ({"do_sample": True}, {"temperature": 1.0, "top_p": 1.0, "top_k": 0}),
        ({"temperature": 0.5}, {"temperature": 0.5}),  # LoRAX: a temperature alone samples
        ({"top_k": 40}, {"temperature": 1.0, "top_k": 40}),
        (
            {"do_sample": True, "temperature": 0.75, "top_p": 0.5, "top_k": 3, "seed": 7},
            {"temperature": 0.75, "top_p": 0.5, "top_k": 3, "seed": 7},
        ),
        (
            {"max_new_tokens": 3, "repetition_penalty": 1.5, "ignore_eos_token": True, "stop": ["x", ""]},
            {"max_tokens": 3, "repetition_penalty": 1.5, "ignore_eos": True, "stop_strings": ["x"]},
        ),
        ({"return_k_alternatives": 3}, {"top_logprobs": 3}),
        (
            {"frequency_penalty": 0.5, "presence_penalty": -1.5},
            {"frequency_penalty": 0.5, "presence_penalty": -1.5},
        ),
    ],
)
async def test_parameters_map_onto_the_engine_sampling(gateway, parameters, expected):
    reply = await gateway.http.post("/generate", json={**BASE, "parameters": parameters})
    assert reply.status_code == 200, reply.text
    got = sampling(gateway)
    assert {name: getattr(got, name) for name in expected} == expected


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [
        ({"type": "json_object"}, types_pb2.StructuredOutput(json_object=True)),
        (
            {"type": "json_object", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}},
            types_pb2.StructuredOutput(json_schema='{"type":"object","properties":{"a":{"type":"integer"}}}'),
        ),
    ],
)
async def test_loraxs_response_format_constrains_the_output(gateway, response_format, expected):
    reply = await gateway.http.post(
        "/generate", json={**BASE, "parameters": {"response_format": response_format}}
    )
    assert reply.status_code == 200, reply.text
    assert sampling(gateway).structured_output == expected


async def test_a_schema_the_worker_cannot_follow_is_refused_naming_response_format(gateway):
    gateway.worker.refusal = (
        "structured_output.json_schema is not a schema loramesh can follow: Invalid type: bogus"
    )
    body = {**BASE, "parameters": {"response_format": {"type": "json_object", "schema": {"type": "bogus"}}}}
    reply = await gateway.http.post("/generate", json=body)
    assert reply.status_code == 422, reply.text
    assert reply.json() == {
        "error": "response_format.schema is not a schema loramesh can follow: Invalid type: bogus",
        "error_type": "validation",
    }


async def test_the_seed_is_in_the_details_only_when_sampling(gateway):
    sampled = {**BASE, "parameters": {"do_sample": True, "seed": 11, "details": True}}
    assert (await gateway.http.post("/generate", json=sampled)).json()["details"]["seed"] == 11
    greedy = {**BASE, "parameters": {"seed": 11, "details": True}}
    assert (await gateway.http.post("/generate", json=greedy)).json()["details"]["seed"] is None


async def test_truncate_keeps_the_last_prompt_tokens_and_return_full_text_prepends_the_inputs(gateway):
    answer = await gateway.http.post(
        "/generate", json={**BASE, "parameters": {"truncate": 2, "return_full_text": True}}
    )
    assert answer.json()["generated_text"] == BASE["inputs"] + TEXT
    [request] = gateway.worker.requests
    assert list(request.prompt_token_ids) == gateway.core.encode(BASE["inputs"])[-2:]


async def test_alternative_tokens_come_with_return_k_alternatives(gateway):
    body = {**BASE, "parameters": {"return_k_alternatives": 2, "details": True}}
    first = (await gateway.http.post("/generate", json=body)).json()["details"]["tokens"][0]
    token = gateway.worker.script[0]
    assert first["alternative_tokens"] == [
        {"id": token, "text": " Hello", "logprob": -1.0},
        {"id": 1, "text": gateway.core.token_bytes(1).decode(), "logprob": -2.0},
    ]
    stream = events(await gateway.http.post("/generate_stream", json=body))
    assert len(stream[0]["token"]["alternative_tokens"]) == 2


@pytest.mark.parametrize(
    ("adapter_id", "store_id"),
    [(None, ""), ("", ""), ("SmolLM2-135M-Instruct", ""), ("pirate", "a1"), ("alice/pirate", "a1"),
     ("bob/shared", "b2")],
)  # fmt: skip
async def test_adapter_id_names_a_loramesh_adapter_or_the_base_model(gateway, adapter_id, store_id):
    reply = await gateway.http.post("/generate", json={**BASE, "parameters": {"adapter_id": adapter_id}})
    assert reply.status_code == 200, reply.text
    assert [r.adapter_id for r in gateway.worker.requests] == [store_id]


REFUSED = {
    "adapter_source": ({"adapter_id": "pirate", "adapter_source": "hub"}, 422, "adapter_source"),
    "merged_adapters": (
        {"merged_adapters": {"ids": ["a", "b"], "weights": [0.5, 0.5]}},
        422,
        "merged_adapters",
    ),
    "best_of": ({"best_of": 2, "do_sample": True}, 422, "best_of"),
    "typical_p": ({"typical_p": 0.5}, 422, "typical_p"),
    "watermark": ({"watermark": True}, 422, "watermark"),
    "decoder_input_details": ({"decoder_input_details": True}, 422, "decoder_input_details"),
    "frequency_penalty out of range": ({"frequency_penalty": 2.5}, 422, "frequency_penalty"),
    "presence_penalty out of range": ({"presence_penalty": -3}, 422, "presence_penalty"),
    "an unknown response_format type": (
        {"response_format": {"type": "regex"}},
        422,
        "parameters.response_format.type",
    ),
    "a response_format schema that is no object": (
        {"response_format": {"type": "json_object", "schema": [1]}},
        422,
        "parameters.response_format.schema",
    ),
    "apply_chat_template": ({"apply_chat_template": True}, 422, "apply_chat_template"),
    "max_new_tokens 0": ({"max_new_tokens": 0}, 422, "max_new_tokens"),
    "max_new_tokens over the limit": ({"max_new_tokens": 100_000}, 422, "max_new_tokens"),
    "negative temperature": ({"temperature": -1}, 422, "temperature"),
    "top_p above 1": ({"top_p": 1.5}, 422, "top_p"),
    "repetition_penalty 0": ({"repetition_penalty": 0}, 422, "repetition_penalty"),
    "negative seed": ({"seed": -3, "do_sample": True}, 422, "seed"),
    "too many alternatives": ({"return_k_alternatives": 50}, 422, "return_k_alternatives"),
    "truncate 0": ({"truncate": 0}, 422, "truncate"),
    "a stop that is no list": ({"stop": 5}, 422, "parameters.stop"),
    "a temperature that is no number": ({"temperature": "hot"}, 422, "parameters.temperature"),
    "an unknown adapter": ({"adapter_id": "nobody/nothing"}, 404, "adapter_id"),
    "a malformed adapter": ({"adapter_id": "a/b/c"}, 422, "adapter_id: adapter 'a/b/c' must be"),
    "another tenant's private adapter": ({"adapter_id": "bob/secret"}, 404, "adapter_id"),
}


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
async def test_what_loramesh_cannot_honour_is_refused_naming_the_field(gateway, case, path):
    parameters, status, named = REFUSED[case]
    reply = await gateway.http.post(path, json={**BASE, "parameters": parameters, "stream": True})
    assert reply.status_code == status, reply.text
    error = reply.json()
    assert named in error["error"]
    assert error["error_type"] == {422: "validation", 404: "not_found", 403: "permission"}[status]
    assert gateway.worker.requests == []


@pytest.mark.parametrize(
    ("content", "headers", "status", "named"),
    [
        (b'{"inputs": "x", ', {}, 422, "not valid JSON"),
        (b'{"parameters": {}}', {}, 422, "inputs"),
        (b'{"inputs": ""}', {}, 422, "inputs cannot be empty"),
        (b'{"inputs": "x"}', {"authorization": ""}, 401, "missing API key"),
        (b'{"inputs": "x"}', {"authorization": "Bearer wrong"}, 401, "invalid API key"),
        (
            b'{"inputs": "x", "parameters": {"api_token": "wrong"}}',
            {"authorization": ""},
            401,
            "invalid API key",
        ),
    ],
)
async def test_bad_bodies_and_keys_are_refused_in_loraxs_shape(gateway, content, headers, status, named):
    reply = await gateway.http.post("/generate", content=content, headers=headers)
    assert reply.status_code == status, reply.text
    assert named in reply.json()["error"] and reply.json()["error_type"]
    assert gateway.worker.requests == []


async def test_api_token_is_the_api_key_when_no_authorization_header_is_sent(gateway):
    body = {**BASE, "parameters": {"adapter_id": "secret", "api_token": "key-bob"}}
    reply = await gateway.http.post("/generate", json=body, headers={"authorization": ""})
    assert reply.status_code == 200, reply.text
    assert [r.adapter_id for r in gateway.worker.requests] == ["b1"]  # bob's own adapter


async def test_a_failure_after_the_stream_started_ends_it_with_an_error_event(gateway):
    gateway.worker.fail_after = 2
    stream = events(await gateway.http.post("/generate_stream", json=BASE))
    assert [e["token"]["text"] for e in stream[:2]] == [" Hello", " world"]
    assert stream[2]["error_type"] == "unavailable" and "failed on 1 workers" in stream[2]["error"]
    assert len(stream) == 3


async def test_a_generation_ended_without_a_token_ends_its_stream_on_a_stand_in_one(gateway):
    """The worker's pool held no more of it: the last reply has no token, and the text held
    back (" world" might begin the stop sequence " worldly") comes with it."""
    gateway.worker.script = gateway.core.encode(" Hello world")
    gateway.worker.end_without_token = True
    body = {**BASE, "parameters": {"stop": [" worldly"], "details": True}}
    stream = events(await gateway.http.post("/generate_stream", json=body))
    eos = min(gateway.core.tokenizer.eos_token_ids)
    assert [e["token"]["id"] for e in stream] == [*gateway.worker.script, eos]
    assert stream[-1]["token"] == {"id": eos, "text": " world", "logprob": 0.0, "special": False}
    assert stream[-1]["generated_text"] == " Hello world"
    assert "".join(e["token"]["text"] for e in stream) == " Hello world"
    assert (
        stream[-1]["details"]["generated_tokens"] == 2 and stream[-1]["details"]["finish_reason"] == "length"
    )
    whole = (await gateway.http.post("/generate", json=body)).json()
    assert whole["generated_text"] == " Hello world" and len(whole["details"]["tokens"]) == 2
