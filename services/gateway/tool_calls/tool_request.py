"""A chat request's tools: OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``,
parsed and checked into :class:`ToolRequest`.

Only function tools exist here (OpenAI's ``custom`` tools are refused by name). A refusal is an
:class:`InvalidField` naming the field as the request spelled it (``tools[1].function.name``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from services.runtime.sampling.request_validation import InvalidField

MAX_TOOLS = 128
"""Most tools one request may define (OpenAI's limit)."""

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A function name, as OpenAI accepts them."""

NO_PARAMETERS = {"type": "object", "properties": {}}
"""The arguments schema of a function defined without ``parameters``: an object with no fields."""

ToolChoiceMode = Literal["auto", "required", "named"]


@dataclass(frozen=True)
class FunctionTool:
    """One function the model may call."""

    name: str
    """What the model writes to call it; unique within the request."""
    description: str
    """What it does, for the model ("" when the request gave none)."""
    parameters: dict[str, Any]
    """JSON Schema of its ``arguments`` object (:data:`NO_PARAMETERS` when the request gave none)."""

    def definition(self) -> dict[str, Any]:
        """The definition as OpenAI's API and chat templates spell it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """The tools a chat request offers and how the model must use them. A request with no tools,
    or with ``tool_choice: "none"``, has none: :func:`parse_tool_request` gives None."""

    tools: tuple[FunctionTool, ...]
    """The functions, in the request's order (at least one)."""
    mode: ToolChoiceMode
    """``auto``: the model may answer or call; ``required``: it must call one of ``tools``;
    ``named``: it must call :attr:`named`."""
    named: str
    """The function ``tool_choice`` names (``mode`` ``named``); "" otherwise."""
    parallel_tool_calls: bool
    """Whether one reply may hold several calls (``auto`` only: a constrained reply is one call)."""

    @property
    def constrained(self) -> bool:
        """The reply must be a call: decoding follows :func:`~.constraint.call_schema`."""
        return self.mode != "auto"

    @property
    def callable_tools(self) -> tuple[FunctionTool, ...]:
        """The functions the reply may call: the named one, or all."""
        return tuple(t for t in self.tools if t.name == self.named) if self.mode == "named" else self.tools

    def tool(self, name: str) -> FunctionTool | None:
        """The callable function called ``name``, if any."""
        return next((t for t in self.callable_tools if t.name == name), None)


def parse_tool_request(
    tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None
) -> ToolRequest | None:
    """The request's tools, from its JSON values (None: the field was absent); None when the
    model is offered no tools (none given, or ``tool_choice`` ``"none"``).

    ``tool_choice`` defaults to ``"auto"`` when tools are given, as OpenAI's; ``"required"`` or
    a named function without tools is refused. ``parallel_tool_calls`` defaults to true.
    """
    functions = _parse_tools(tools)
    mode, named = _parse_tool_choice(tool_choice, functions)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidField(
            "parallel_tool_calls", f"parallel_tool_calls must be true or false, got {parallel_tool_calls!r}"
        )
    if mode == "none" or not functions:
        return None
    return ToolRequest(functions, mode, named, parallel_tool_calls is not False)


def _parse_tools(tools: Any) -> tuple[FunctionTool, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise InvalidField("tools", f"tools must be a list of function tools, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise InvalidField("tools", f"tools has {len(tools)} entries; at most {MAX_TOOLS}")
    functions: list[FunctionTool] = []
    for i, tool in enumerate(tools):
        function = _parse_tool(tool, f"tools[{i}]")
        for j, earlier in enumerate(functions):
            if earlier.name == function.name:
                raise InvalidField(
                    f"tools[{i}].function.name",
                    f"tools[{i}].function.name {function.name!r} is already the name of tools[{j}]",
                )
        functions.append(function)
    return tuple(functions)


def _parse_tool(tool: Any, field: str) -> FunctionTool:
    if not isinstance(tool, dict):
        raise InvalidField(field, f"{field} must be an object, got {type(tool).__name__}")
    if tool.get("type") != "function":
        raise InvalidField(
            f"{field}.type",
            f"{field}.type must be 'function' (the only tools supported), got {tool.get('type')!r}",
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidField(f"{field}.function", f"{field}.function must be an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidField(
            f"{field}.function.name",
            f"{field}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidField(f"{field}.function.description", f"{field}.function.description must be a string")
    # strict is accepted either way: under a constraint the arguments always follow parameters.
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise InvalidField(f"{field}.function.strict", f"{field}.function.strict must be true or false")
    return FunctionTool(name, description or "", _parse_parameters(function.get("parameters"), field))


def _parse_parameters(parameters: Any, field: str) -> dict[str, Any]:
    if parameters is None:
        return NO_PARAMETERS
    if not isinstance(parameters, dict):
        raise InvalidField(
            f"{field}.function.parameters",
            f"{field}.function.parameters must be a JSON Schema object, got {type(parameters).__name__}",
        )
    # Arguments are always a JSON object: a schema of anything else could never be called.
    if parameters.get("type", "object") != "object":
        raise InvalidField(
            f"{field}.function.parameters.type",
            f"{field}.function.parameters.type must be 'object', got {parameters['type']!r}",
        )
    return parameters


def _parse_tool_choice(tool_choice: Any, functions: tuple[FunctionTool, ...]) -> tuple[str, str]:
    """``(mode, named function)``; mode ``none`` when no tool may be called."""
    if tool_choice is None:
        return ("auto" if functions else "none"), ""
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidField(
                "tool_choice",
                f"tool_choice must be 'none', 'auto', 'required' or a function, got {tool_choice!r}",
            )
        if tool_choice == "required" and not functions:
            raise InvalidField("tool_choice", "tool_choice 'required' needs tools")
        return tool_choice, ""
    if not isinstance(tool_choice, dict):
        raise InvalidField(
            "tool_choice", f"tool_choice must be a string or an object, got {type(tool_choice).__name__}"
        )
    if tool_choice.get("type") != "function":
        raise InvalidField(
            "tool_choice.type", f"tool_choice.type must be 'function', got {tool_choice.get('type')!r}"
        )
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidField("tool_choice.function.name", "tool_choice.function.name must name a function")
    if not any(f.name == name for f in functions):
        known = ", ".join(repr(f.name) for f in functions) or "none"
        raise InvalidField(
            "tool_choice.function.name",
            f"tool_choice.function.name {name!r} is not one of the tools (tools: {known})",
        )
    return "named", name
