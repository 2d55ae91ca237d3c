"""A whole reply split into content and OpenAI-shaped tool calls: the constrained call, tagged
and bare calls under ``auto``, and everything that is not a call left in the text."""

from __future__ import annotations

import re

import pytest

from services.gateway.tool_calls import parse_reply, parse_tool_request

WEATHER = {"type": "function", "function": {"name": "get_weather"}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
AUTO = parse_tool_request([WEATHER, CLOCK])
REQUIRED = parse_tool_request([WEATHER, CLOCK], "required")


def calls(reply) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in reply.tool_calls]


def test_a_constrained_reply_is_one_call_in_openai_s_shape():
    reply = parse_reply('{"name": "get_weather", "arguments": {"city": "Paris"}}', REQUIRED)
    (call,) = reply.tool_calls
    assert reply.content is None and reply.finish_reason("stop") == "tool_calls"
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    assert call.to_openai() == {
        "id": call.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }


def test_a_constrained_reply_cut_short_is_text_with_its_finish_reason():
    text = '{"name": "get_weather", "arguments": {"city": "Par'
    reply = parse_reply(text, REQUIRED)
    assert (reply.content, reply.tool_calls, reply.finish_reason("length")) == (text, (), "length")


def test_tagged_calls_are_taken_out_of_the_text_around_them():
    text = (
        "Let me check both.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nOne moment.'
    )
    reply = parse_reply(text, AUTO)
    assert reply.content == "Let me check both.\nOne moment."
    assert calls(reply) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert len({c.id for c in reply.tool_calls}) == 2


def test_arguments_are_passed_on_exactly_as_the_model_wrote_them():
    arguments = '{ "n": 1e3,  "s": "caf\\u00e9 } <tool_call>", "list": [1, {"x": []}] }'
    reply = parse_reply(f'<tool_call>{{"name": "get_time", "arguments": {arguments}}}</tool_call>', AUTO)
    assert calls(reply) == [("get_time", arguments)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', [("get_weather", '{"city": "Oslo"}')]),
        ('  {"name": "get_weather", "parameters": {"city": "Oslo"}}', [("get_weather", '{"city": "Oslo"}')]),
        ('{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}', [("get_time", '{"tz": "UTC"}')]),
        ('<tool_call>{"arguments": {}, "name": "get_time"}</tool_call>', [("get_time", "{}")]),
    ],
)
def test_other_spellings_of_a_call_are_read_under_auto(text, expected):
    reply = parse_reply(text, AUTO)
    assert calls(reply) == expected and reply.content is None


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.\n",
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call> I cannot.',
        '<tool_call>{"name": "get_time", "arguments": {"tz": }}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
        "Sure <tool_call>not json",
        '{"city": "Paris", "name": "get_weather"}',
        '{"name": "get_weather", "arguments": {"city": "Par',
        '["get_weather"]',
        "a <tool_call",
        '<tool_call>{"name": "get\\q", "arguments": {}}</tool_call>',
        '{"name": "get\ntime", "arguments": {}}',
    ],
)
def test_what_is_not_a_call_of_a_known_tool_stays_text_as_written(text):
    reply = parse_reply(text, AUTO)
    assert reply.tool_calls == () and reply.content == text
    assert reply.finish_reason("stop") == "stop"


def test_text_after_a_bare_call_is_content():
    reply = parse_reply('{"name": "get_time", "arguments": {}}\nDone.', AUTO)
    assert calls(reply) == [("get_time", "{}")] and reply.content == "\nDone."


def test_without_parallel_calls_only_the_first_call_is_kept():
    single = parse_tool_request([WEATHER, CLOCK], "auto", False)
    text = (
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    )
    assert calls(parse_reply(text, single)) == [("get_time", "{}")]
    assert len(parse_reply(text, AUTO).tool_calls) == 2


def test_a_named_choice_reads_only_a_call_of_that_function():
    named = parse_tool_request([WEATHER, CLOCK], {"type": "function", "function": {"name": "get_time"}})
    assert calls(parse_reply('{"name": "get_time", "arguments": {}}', named)) == [("get_time", "{}")]
    assert parse_reply('{"name": "get_weather", "arguments": {}}', named).tool_calls == ()
