"""Tool calls on ``/v1/chat/completions``, on a real gateway core in front of a scripted worker:
a required or named tool constrains the worker to its call's schema; the reply comes back as
OpenAI's tool calls, whole or streamed as deltas whose arguments join to the call's; under
``auto`` a ``<tool_call>`` block is read out of the text; the history's tool calls and results
reach the prompt; bad tool definitions are 400s naming the field."""

from __future__ import annotations

import json

import jsonschema

from services.gateway.tool_calls import call_schema, parse_tool_request

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
CHAT = {"model": "pirate", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 40}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def script(gateway, text: str) -> None:
    """The worker's reply: ``text`` then the end of the turn, as a model ends it."""
    gateway.worker.script = [*gateway.core.encode(text), gateway.core.tokenizer.eos_token_ids[0]]


async def test_required_constrains_the_worker_and_answers_with_the_call(scripted_gateway):
    script(scripted_gateway, CALL)
    reply = await scripted_gateway.http.post(
        "/v1/chat/completions", json={**CHAT, "tools": [WEATHER, TIME], "tool_choice": "required"}
    )
    assert reply.status_code == 200, reply.text
    [request] = scripted_gateway.worker.requests
    schema = json.loads(request.sampling.structured_output.json_schema)
    assert schema == call_schema(parse_tool_request([WEATHER, TIME], "required", None))
    jsonschema.validate(json.loads(CALL), schema)
    [choice] = reply.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


async def test_a_named_tool_streams_as_deltas_that_join_to_the_call(scripted_gateway):
    script(scripted_gateway, CALL)
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {**CHAT, "tools": [WEATHER, TIME], "tool_choice": named, "stream": True}
    async with scripted_gateway.http.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200
        lines = [line async for line in reply.aiter_lines() if line.startswith("data: {")]
    choices = [json.loads(line.removeprefix("data: "))["choices"][0] for line in lines]
    calls = [piece for c in choices for piece in c["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads("".join(piece["function"]["arguments"] for piece in calls)) == {"city": "Paris"}
    assert not any(c["delta"].get("content") for c in choices)
    assert choices[-1]["finish_reason"] == "tool_calls"


async def test_auto_reads_a_tagged_call_out_of_the_text_and_leaves_plain_replies_alone(scripted_gateway):
    script(scripted_gateway, f"Let me look.\n<tool_call>{CALL}</tool_call>")
    reply = await scripted_gateway.http.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER]})
    [request] = scripted_gateway.worker.requests
    assert not request.sampling.HasField("structured_output")  # auto: the model may answer in text
    message = reply.json()["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert message["content"].strip() == "Let me look."
    script(scripted_gateway, "It is sunny.")
    reply = await scripted_gateway.http.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER]})
    [choice] = reply.json()["choices"]
    assert (
        choice["message"] == {"role": "assistant", "content": "It is sunny."}
        and choice["finish_reason"] != "tool_calls"
    )


async def test_the_tools_and_the_history_of_calls_and_results_reach_the_prompt(scripted_gateway):
    script(scripted_gateway, "Sunny.")
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"},
    ]
    reply = await scripted_gateway.http.post(
        "/v1/chat/completions", json={**CHAT, "messages": history, "tools": [WEATHER]}
    )
    assert reply.status_code == 200, reply.text
    prompt = scripted_gateway.core.tokenizer.decode(
        list(scripted_gateway.worker.requests[0].prompt_token_ids)
    )
    assert "get_weather" in prompt and "The weather in a city" in prompt  # the tool, described
    assert '"city": "Paris"' in prompt and "22 C and sunny" in prompt  # the call and its result


async def test_bad_tool_requests_are_400s_naming_the_field(scripted_gateway):
    cases = {
        "tools[0].function": {"tools": [{"type": "function"}]},
        "tool_choice": {"tool_choice": "required"},
        "tool_choice.function.name": {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "logprobs": {"tools": [WEATHER], "logprobs": True},
    }  # fmt: skip
    for param, extra in cases.items():
        reply = await scripted_gateway.http.post("/v1/chat/completions", json={**CHAT, **extra})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, (param, reply.text)
    both = {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}
    reply = await scripted_gateway.http.post("/v1/chat/completions", json={**CHAT, **both})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tool_choice"
    assert scripted_gateway.worker.requests == []
