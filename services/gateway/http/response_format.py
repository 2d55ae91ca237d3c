"""``response_format``: what shape the output must have, read into the engine's structured output.

OpenAI's three forms: ``{"type": "text"}`` (free text), ``{"type": "json_object"}`` (any JSON
object) and ``{"type": "json_schema", "json_schema": {"name", "schema", "strict",
"description"}}`` (an instance of ``schema``). LoRAX's form, ``{"type": "json_object", "schema":
{...}}``, is read too, on every route: a ``json_object`` with a schema is constrained to it.

Only the shape is checked here; the worker compiles the schema and refuses one it cannot follow
(``INVALID_ARGUMENT`` naming ``structured_output``, which :mod:`.errors` reports as
``response_format``). ``strict: false`` is enforced all the same, as vLLM does: a grammar either
constrains the output or it does not.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mesh_api.v1 import types_pb2
from services.gateway.http.errors import OpenAIError

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
"""OpenAI's rule for ``json_schema.name``."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    """LoRAX's ``json_object`` schema (OpenAI's ``json_object`` has none)."""

    def structured_output(self, field: str = "response_format") -> types_pb2.StructuredOutput | None:
        """The engine's constraint; None for free text. ``field``: how the request names this
        object, for refusals."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            if self.schema_ is None:
                return types_pb2.StructuredOutput(json_object=True)
            return types_pb2.StructuredOutput(json_schema=_schema_text(self.schema_))
        if self.json_schema is None:
            raise OpenAIError(
                400, f"{field}.json_schema is required with type json_schema", f"{field}.json_schema"
            )
        if self.json_schema.schema_ is None:
            where = f"{field}.json_schema.schema"
            raise OpenAIError(400, f"{where} is required: give the JSON Schema the output must follow", where)
        return types_pb2.StructuredOutput(json_schema=_schema_text(self.json_schema.schema_))


def _schema_text(schema: dict[str, Any]) -> str:
    # Compact, keys in the order given: properties are generated in schema order, and equal
    # schemas give equal text, which is what the worker's grammar cache is keyed by.
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
