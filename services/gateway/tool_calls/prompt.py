"""What a chat template is given for a chat with tools: its messages and its ``tools``.

A template that reads ``tools`` (an adapter's, or a base model's trained on tool use) lays the
tools out itself and renders calls and results its own way: it gets the tools' definitions, the
assistant messages' ``tool_calls`` (arguments as objects, as transformers' templates expect) and
the ``tool`` messages with their ``tool_call_id`` and function ``name``.

A template that does not (SmolLM2's) gets plain messages: a system message, merged into the
chat's own, lists the tools as JSON and states how to call them; an assistant's calls are
written as the text it is asked to write (``<tool_call>`` blocks, Hermes' format, which
:mod:`.output_stream` reads back), and a tool's result is a ``tool`` turn in
``<tool_response>`` tags.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.gateway.tool_calls.chat_message import ChatMessage
from services.gateway.tool_calls.json_text import object_members
from services.gateway.tool_calls.output_stream import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from services.gateway.tool_calls.tool_call import ToolCall
from services.gateway.tool_calls.tool_request import ToolRequest
from services.model_files.chat_template import chat_template_variables

_CALL_SHAPE = '{"name": <function name>, "arguments": <arguments object>}'


@dataclass(frozen=True)
class TemplateInput:
    """The chat template's ``messages`` and ``tools``."""

    messages: list[dict[str, Any]]
    """The messages as the template reads them."""
    tools: list[dict[str, Any]] | None
    """The tools' definitions for a template that lays them out itself; None otherwise (or when
    no tools are offered)."""


def template_input(
    messages: Sequence[ChatMessage], request: ToolRequest | None, chat_template: str | None
) -> TemplateInput:
    """What ``chat_template`` is given for ``messages``, offering ``request``'s tools (None:
    none are offered; the history may still hold calls and results)."""
    if chat_template is not None and "tools" in chat_template_variables(chat_template):
        names = {call.id: call.name for message in messages for call in message.tool_calls}
        tools = [tool.definition() for tool in request.tools] if request is not None else None
        return TemplateInput([_structured(message, names) for message in messages], tools)
    plain = [_plain(message) for message in messages]
    if request is not None:
        plain = _with_tools_system_message(plain, request)
    return TemplateInput(plain, None)


# -- for templates that know tools -------------------------------------------------------------


def _structured(message: ChatMessage, call_names: dict[str, str]) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments_value(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.role == "tool":
        rendered["tool_call_id"] = message.tool_call_id
        if message.tool_call_id in call_names:
            rendered["name"] = call_names[message.tool_call_id]
    return rendered


def _arguments_value(arguments: str) -> Any:
    """The arguments as an object when they are one (templates write them with ``tojson``)."""
    return json.loads(arguments) if object_members(arguments) is not None else arguments


# -- for templates that do not -----------------------------------------------------------------


def _plain(message: ChatMessage) -> dict[str, str]:
    if message.role == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{message.content}\n</tool_response>"}
    if not message.tool_calls:
        return {"role": message.role, "content": message.content}
    blocks = [f"{TOOL_CALL_OPEN}\n{_call_text(call)}\n{TOOL_CALL_CLOSE}" for call in message.tool_calls]
    return {
        "role": message.role,
        "content": "\n".join([message.content, *blocks] if message.content else blocks),
    }


def _call_text(call: ToolCall) -> str:
    """A call as the model is asked to write one."""
    arguments = call.arguments if object_members(call.arguments) is not None else json.dumps(call.arguments)
    return f'{{"name": {json.dumps(call.name, ensure_ascii=False)}, "arguments": {arguments}}}'


def _with_tools_system_message(messages: list[dict[str, str]], request: ToolRequest) -> list[dict[str, str]]:
    text = _tools_text(request)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _tools_text(request: ToolRequest) -> str:
    definitions = "\n".join(json.dumps(tool.definition(), ensure_ascii=False) for tool in request.tools)
    listing = (
        "You can call functions. Each is described by a JSON Schema of its arguments:\n"
        f"<tools>\n{definitions}\n</tools>\n"
    )
    if request.mode == "named":
        call = f'{{"name": {json.dumps(request.named)}, "arguments": <arguments object>}}'
        return f"{listing}Call {request.named} now: reply with only this JSON object: {call}"
    if request.mode == "required":
        return f"{listing}Call one of them now: reply with only this JSON object: {_CALL_SHAPE}"
    how_many = (
        "You may call several functions, one block each."
        if request.parallel_tool_calls
        else "Call at most one function."
    )
    return (
        f"{listing}To call a function, write this JSON object inside {TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} tags:\n"
        f"{TOOL_CALL_OPEN}\n{_CALL_SHAPE}\n{TOOL_CALL_CLOSE}\n"
        f"{how_many} If no function is needed, answer directly."
    )
