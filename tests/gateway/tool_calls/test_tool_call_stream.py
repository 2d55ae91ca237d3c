"""Streamed replies: however the text is cut into deltas, a call is announced once (id, type,
name, empty arguments), its argument pieces join to exactly the arguments, the content deltas
join to the reply's text, and the whole matches what the whole reply parses to."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.tool_calls import ToolCallStream, parse_reply, parse_tool_request

WEATHER = {"type": "function", "function": {"name": "get_weather"}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
AUTO = parse_tool_request([WEATHER, CLOCK])
NAMED = parse_tool_request([WEATHER, CLOCK], {"type": "function", "function": {"name": "get_weather"}})

REPLIES = [
    (NAMED, '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"x": "}"}]}}'),
    (
        AUTO,
        (
            "Checking.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "P\\"aris <tool_call>"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nDone <b>.'
        ),
    ),
    (AUTO, '{"name": "get_time", "arguments": {"tz": "UTC"}} and text'),
    (AUTO, '<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}</tool_call>'),
    (AUTO, '<tool_call>{"name": "nope", "arguments": {}}</tool_call> so <tool_ nothing'),
    (AUTO, 'Plain text, no calls: {"a": 1} < > <tool'),
    (AUTO, '<tool_call>{"name": "bad\\escape", "arguments": {}}</tool_call>'),
]


def stream(request, text: str, cuts: list[int]) -> tuple[list[dict], ToolCallStream]:
    """``text`` fed in pieces cut at ``cuts``, then finished: every delta, in order."""
    tool_stream = ToolCallStream(request)
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    deltas = [d for start, end in itertools.pairwise(bounds) for d in tool_stream.feed(text[start:end])]
    return deltas + tool_stream.finish(), tool_stream


def joined(deltas: list[dict]) -> tuple[str, list[dict]]:
    """The content, and each call as ``{"id", "name", "arguments"}``, checking the deltas' shapes."""
    content, calls = "", []
    for delta in deltas:
        assert len(delta) == 1
        if "content" in delta:
            assert delta["content"]
            content += delta["content"]
            continue
        (entry,) = delta["tool_calls"]
        if "id" in entry:  # the announcement comes first, once per call
            assert entry["index"] == len(calls) and entry["type"] == "function"
            assert entry["function"]["arguments"] == ""
            calls.append({"id": entry["id"], "name": entry["function"]["name"], "arguments": ""})
        else:
            assert entry.keys() == {"index", "function"} and entry["function"].keys() == {"arguments"}
            calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    return content, calls


@settings(max_examples=60, deadline=None)
@given(reply=st.sampled_from(REPLIES), cuts=st.lists(st.integers(0, 400), max_size=40))
def test_any_cutting_streams_the_reply_the_whole_reply_parses_to(reply, cuts):
    request, text = reply
    deltas, tool_stream = stream(request, text, cuts)
    content, calls = joined(deltas)
    whole = parse_reply(text, request)
    assert content == (whole.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert [c["id"] for c in calls] == [c.id for c in tool_stream.calls]


def test_a_call_is_announced_as_soon_as_its_name_and_arguments_begin():
    tool_stream = ToolCallStream(AUTO)
    assert tool_stream.feed('<tool_call>{"name": "get_weather", "argu') == []
    announced, first_piece = tool_stream.feed('ments": {"ci')
    assert announced["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first_piece == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert tool_stream.feed("") == []
    rest = tool_stream.feed('ty": "Oslo"}}\n</tool_call>')
    assert joined([announced, first_piece, *rest])[1][0]["arguments"] == '{"city": "Oslo"}'
    assert tool_stream.finish() == [] and tool_stream.finish_reason("stop") == "tool_calls"


def test_text_streams_at_once_except_what_may_begin_a_tag_and_space_before_a_call():
    tool_stream = ToolCallStream(AUTO)
    assert tool_stream.feed("Hello") == [{"content": "Hello"}]
    assert tool_stream.feed(" there\n<tool") == [{"content": " there"}]
    assert tool_stream.feed("box>") == [{"content": "\n<toolbox>"}]
    assert tool_stream.feed(" \n<tool_call>") == []
    assert (
        tool_stream.feed('{"name": "get_time", "arguments": {}}</tool_call>\n')[0]["tool_calls"][0]["index"]
        == 0
    )
    assert tool_stream.finish() == []  # the newline after a call is dropped


def test_a_call_cut_off_by_the_length_limit_keeps_what_was_streamed():
    deltas, tool_stream = stream(NAMED, '{"name": "get_weather", "arguments": {"city": "Pa', [])
    assert joined(deltas) == (
        "",
        [{"id": tool_stream.calls[0].id, "name": "get_weather", "arguments": '{"city": "Pa'}],
    )
    assert tool_stream.finish_reason("length") == "length"


def test_a_reply_with_no_call_keeps_its_finish_reason_and_its_trailing_space():
    deltas, tool_stream = stream(AUTO, "Just text.\n", [3])
    assert joined(deltas) == ("Just text.\n", [])
    assert tool_stream.finish_reason("stop") == "stop"
