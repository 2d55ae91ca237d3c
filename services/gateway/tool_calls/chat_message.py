"""One message of a chat's history, tool calls and tool results included."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.tool_calls.tool_call import ToolCall
from services.runtime.sampling.request_validation import InvalidField


@dataclass(frozen=True)
class ChatMessage:
    """A message as the chat template renders it (:mod:`.prompt`)."""

    role: str
    """``system``, ``user``, ``assistant`` or ``tool`` (a front end maps OpenAI's ``developer``
    to ``system``)."""
    content: str = ""
    """The text ("" for an assistant message that only calls functions)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """The calls an assistant message made."""
    tool_call_id: str = ""
    """The call a ``tool`` message answers."""


def parse_message_tool_calls(tool_calls: Any, field: str) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` (JSON values; None: absent), checked; ``field``
    names the list in refusals (``messages[2].tool_calls``).

    ``arguments`` must be a string but need not be JSON: it was the model's, and is rendered
    back as it was.
    """
    if tool_calls is None:
        return ()
    if not isinstance(tool_calls, list):
        raise InvalidField(field, f"{field} must be a list, got {type(tool_calls).__name__}")
    calls = []
    for j, call in enumerate(tool_calls):
        where = f"{field}[{j}]"
        if not isinstance(call, dict):
            raise InvalidField(where, f"{where} must be an object, got {type(call).__name__}")
        if call.get("type", "function") != "function":
            raise InvalidField(f"{where}.type", f"{where}.type must be 'function', got {call['type']!r}")
        if not isinstance(call.get("id"), str):
            raise InvalidField(f"{where}.id", f"{where}.id must be a string")
        function = call.get("function")
        if not isinstance(function, dict):
            raise InvalidField(f"{where}.function", f"{where}.function must be an object")
        if not isinstance(function.get("name"), str):
            raise InvalidField(f"{where}.function.name", f"{where}.function.name must be a string")
        if not isinstance(function.get("arguments"), str):
            raise InvalidField(
                f"{where}.function.arguments", f"{where}.function.arguments must be a string of JSON"
            )
        calls.append(ToolCall(call["id"], function["name"], function["arguments"]))
    return tuple(calls)
