"""The JSON Schema a constrained reply follows, so that even a small model's call parses.

With ``tool_choice`` ``required`` or a named function, the reply is exactly one call written as
``{"name": "<function>", "arguments": {...}}``: the name a constant, the arguments an instance of
that function's ``parameters``. ``required`` allows any of the tools (``anyOf``, one branch per
function, told apart by the constant name). The worker's grammar writes the properties in the
schema's order, so the name always comes first and a stream can announce the call before its
arguments.

One call only, even with ``parallel_tool_calls``: a reply of several calls would need a grammar
over a list, and a forced reply rarely needs more than one. ``auto`` is not constrained (the
model may answer in text) and ``none`` offers no tools.
"""

from __future__ import annotations

from typing import Any

from services.gateway.tool_calls.tool_request import FunctionTool, ToolRequest

_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are JSON data, not schemas: a ``$ref`` in them is not a reference."""
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
"""Keywords whose values map names to schemas: a name there is not a keyword."""


def call_schema(request: ToolRequest) -> dict[str, Any] | None:
    """The schema of the reply (compact JSON, for the worker's ``json_schema`` constraint);
    None when the reply is free (``auto``)."""
    if not request.constrained:
        return None
    tools = request.callable_tools
    if len(tools) == 1:
        return _call(tools[0], "#")
    return {"anyOf": [_call(tool, f"#/anyOf/{i}") for i, tool in enumerate(tools)]}


def _call(tool: FunctionTool, pointer: str) -> dict[str, Any]:
    """The schema of a call of ``tool``, placed in the whole schema at JSON pointer ``pointer``."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.name},
            "arguments": _relocated(tool.parameters, f"{pointer}/properties/arguments"),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _relocated(schema: Any, pointer: str) -> Any:
    """``schema`` with its local references (``#/$defs/...``, which point into the parameters'
    own root) rewritten to point into ``pointer``, where it now sits."""
    if isinstance(schema, list):
        return [_relocated(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            moved[key] = pointer + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            moved[key] = {name: _relocated(item, pointer) for name, item in value.items()}
        elif key in _DATA_KEYWORDS:
            moved[key] = value
        else:
            moved[key] = _relocated(value, pointer)
    return moved
