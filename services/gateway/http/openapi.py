"""``GET /openapi.json``: an OpenAPI 3.1 document of every route on the HTTP port, built from
the app's own routes and the pydantic models their handlers parse the bodies with.

The request bodies' schemas are the models' JSON Schemas (what the handlers accept; a body that
fits them may still be refused by a check the schema cannot say, with a 4xx naming the field).
Responses are described by status only, with OpenAI's error JSON for the refusals. The document
is built from ``request.app.routes`` when asked, so a route added to the app is listed; a POST
route without an entry in :data:`REQUEST_BODIES` is listed without a body schema, which the
fuzz test (tests/gateway/http/test_fuzz_http.py) refuses. Like vLLM's, it needs no API key.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from mesh_api.version import VERSION
from services.gateway.http.lorax.requests import LoraxGenerateBody
from services.gateway.http.openai.requests import ChatCompletionBody, CompletionBody
from services.gateway.http.vllm.adapter_routes import LoadLoraAdapterBody, UnloadLoraAdapterBody
from services.gateway.http.vllm.tokenize_routes import DetokenizeBody, TokenizeBody

PATH = "/openapi.json"

REQUEST_BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("POST", "/v1/completions"): CompletionBody,
    ("POST", "/v1/chat/completions"): ChatCompletionBody,
    ("POST", "/v1/load_lora_adapter"): LoadLoraAdapterBody,
    ("POST", "/v1/unload_lora_adapter"): UnloadLoraAdapterBody,
    ("POST", "/tokenize"): TokenizeBody,
    ("POST", "/detokenize"): DetokenizeBody,
    ("POST", "/"): LoraxGenerateBody,
    ("POST", "/generate"): LoraxGenerateBody,
    ("POST", "/generate_stream"): LoraxGenerateBody,
}
"""(method, path) -> the model the handler parses the JSON body with."""

NO_KEY = frozenset({"/health", "/ping", "/version", "/metrics", PATH})
"""Paths served without an API key (vLLM's server routes and this document)."""

NO_BODY = frozenset({("POST", "/ping")})
"""POST routes that read no body (SageMaker's health check): listed without a body schema."""

ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}
"""OpenAI's error JSON."""

LORAX_PATHS = frozenset({"/", "/generate", "/generate_stream"})
LORAX_ERROR_SCHEMA = {
    "type": "object",
    "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}},
    "required": ["error", "error_type"],
}
"""LoRAX's error JSON, which its routes answer with (422 for what OpenAI's routes answer 400)."""

_PARAMETER = re.compile(r"{([^}:]+)(?::[^}]+)?}")


def _operations(routes: Iterable[BaseRoute]) -> list[tuple[str, str, Route]]:
    """``(method, path, route)`` for each method of each HTTP route (HEAD, which Starlette adds
    to every GET, left out)."""
    found = []
    for route in routes:
        if isinstance(route, Route):
            for method in sorted(route.methods or ()):
                if method != "HEAD":
                    found.append((method, route.path, route))
    return found


def operations(routes: Iterable[BaseRoute]) -> list[tuple[str, str]]:
    """``(method, path)`` of every operation the document lists for ``routes``."""
    return [(method, path) for method, path, _ in _operations(routes)]


def openapi_document(routes: Sequence[BaseRoute]) -> dict[str, Any]:
    """The document for ``routes`` (an app's ``routes``)."""
    models = sorted(set(REQUEST_BODIES.values()), key=lambda m: m.__name__)
    refs, schemas = models_json_schema(
        [(model, "validation") for model in models], ref_template="#/components/schemas/{model}"
    )
    paths: dict[str, dict[str, Any]] = {}
    for method, path, route in _operations(routes):
        template = _PARAMETER.sub(r"{\1}", path)
        operation: dict[str, Any] = {
            "operationId": f"{method.lower()} {template}",
            "summary": (route.endpoint.__doc__ or route.name or "").strip().split("\n")[0],
            "responses": {
                "200": {"description": "the answer (JSON, text, or server-sent events when streaming)"},
                "4XX": {
                    "description": "refused, naming the field when a field is at fault",
                    "content": {
                        "application/json": {
                            "schema": LORAX_ERROR_SCHEMA if path in LORAX_PATHS else ERROR_SCHEMA
                        }
                    },
                },
                "503": {"description": "the gateway or the mesh behind it cannot serve it now"},
            },
        }
        parameters = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in _PARAMETER.findall(path)
        ]
        if parameters:
            operation["parameters"] = parameters
        model = REQUEST_BODIES.get((method, path))
        if model is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": refs[(model, "validation")]}},
            }
        if path not in NO_KEY:
            operation["security"] = [{"bearer": []}]
        paths.setdefault(template, {})[method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "loramesh gateway: OpenAI-compatible, vLLM and LoRAX HTTP API",
            "version": VERSION,
            "description": "docs/api.md, 'OpenAI-compatible HTTP API (gateway)'",
        },
        "paths": paths,
        "components": {
            "schemas": schemas.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


async def _serve(request: Request) -> Response:
    """This document."""
    app = request.app
    document = getattr(app.state, "openapi_document", None)
    if document is None:  # built once: the app's routes do not change while it runs
        document = app.state.openapi_document = openapi_document(app.routes)
    return JSONResponse(document)


def openapi_route() -> Route:
    return Route(PATH, _serve, methods=["GET"])
