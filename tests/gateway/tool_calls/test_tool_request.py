"""OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` into a ToolRequest; every bad
value refused naming its field as the request spells it."""

from __future__ import annotations

import pytest

from services.gateway.tool_calls import FunctionTool, parse_message_tool_calls, parse_tool_request
from services.gateway.tool_calls.tool_request import MAX_TOOLS, NO_PARAMETERS
from services.runtime.sampling.request_validation import InvalidField

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER_PARAMETERS},
}
CLOCK = {"type": "function", "function": {"name": "get-time", "strict": True}}


def test_tools_parse_into_functions_with_auto_as_the_default_choice():
    request = parse_tool_request([WEATHER, CLOCK])
    assert request.tools == (
        FunctionTool("get_weather", "Weather now", WEATHER_PARAMETERS),
        FunctionTool("get-time", "", NO_PARAMETERS),
    )
    assert (request.mode, request.named, request.parallel_tool_calls) == ("auto", "", True)
    assert not request.constrained and request.callable_tools == request.tools
    assert request.tools[1].definition() == {
        "type": "function",
        "function": {"name": "get-time", "parameters": NO_PARAMETERS},
    }


def test_choices_required_and_named_constrain_the_reply():
    required = parse_tool_request([WEATHER, CLOCK], "required", False)
    assert required.mode == "required" and required.constrained and not required.parallel_tool_calls
    named = parse_tool_request([WEATHER, CLOCK], {"type": "function", "function": {"name": "get-time"}})
    assert (named.mode, named.named, named.constrained) == ("named", "get-time", True)
    assert [t.name for t in named.callable_tools] == ["get-time"]
    assert named.tool("get-time") is not None and named.tool("get_weather") is None


@pytest.mark.parametrize(
    ("tools", "tool_choice"), [(None, None), ([], None), ([WEATHER], "none"), (None, "none"), (None, "auto")]
)
def test_no_tools_offered_is_none(tools, tool_choice):
    assert parse_tool_request(tools, tool_choice) is None


BAD = [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [WEATHER] * (MAX_TOOLS + 1)}, "tools"),
    ({"tools": [WEATHER, "x"]}, "tools[1]"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "has space"}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, CLOCK, WEATHER]}, "tools[2].function.name"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
        "tools[0].function.description",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
        "tools[0].function.strict",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
        "tools[0].function.parameters",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools[0].function.parameters.type",
    ),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": 1}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
    ),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
]


@pytest.mark.parametrize(("fields", "field"), BAD, ids=[f"{field}-{i}" for i, (_, field) in enumerate(BAD)])
def test_bad_tool_fields_are_refused_naming_the_field(fields, field):
    with pytest.raises(InvalidField) as refused:
        parse_tool_request(fields.get("tools"), fields.get("tool_choice"), fields.get("parallel_tool_calls"))
    assert refused.value.field == field
    assert field in str(refused.value)


def test_an_unknown_named_function_is_refused_listing_the_tools():
    with pytest.raises(InvalidField, match="'nope' is not one of the tools \\(tools: 'get_weather'\\)"):
        parse_tool_request([WEATHER], {"type": "function", "function": {"name": "nope"}})


def test_history_tool_calls_parse_and_are_checked():
    raw = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    (call,) = parse_message_tool_calls(raw, "messages[1].tool_calls")
    assert (call.id, call.name, call.arguments) == ("call_1", "f", '{"a": 1}')
    assert call.to_openai() == raw[0]
    assert parse_message_tool_calls(None, "messages[1].tool_calls") == ()
    bad_arguments = [{"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}]
    with pytest.raises(InvalidField) as refused:
        parse_message_tool_calls(bad_arguments, "messages[1].tool_calls")
    assert refused.value.field == "messages[1].tool_calls[0].function.arguments"
    with pytest.raises(InvalidField) as refused:
        parse_message_tool_calls([{"function": {"name": "f", "arguments": "{}"}}], "messages[3].tool_calls")
    assert refused.value.field == "messages[3].tool_calls[0].id"
