"""What every dialect reads of a request: the caller's tenant (from its API key), and its body:
bounded in size, JSON, checked against the route's pydantic model, refused with a 4xx naming
what is wrong (:class:`.errors.OpenAIError`)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from services.gateway.core import GatewayCore
from services.gateway.http.errors import OpenAIError

MAX_BODY_BYTES = 8 * 2**20
"""Largest request body read; prompts are limited to a few thousand tokens, so this is generous."""

B = TypeVar("B", bound=BaseModel)


def tenant(core: GatewayCore, request: Request) -> str:
    """The tenant of the request's ``Authorization: Bearer <key>``."""
    return core.tenant(request.headers.get("authorization", ""))


async def read_body(chunks: AsyncIterator[bytes], max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refused (413) past ``max_bytes`` without reading the rest into memory."""
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > max_bytes:
            raise OpenAIError(413, f"the request body is over {max_bytes} bytes", None, "request_too_large")
    return bytes(body)


_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A ``\\uD800``-``\\uDFFF`` escape: the only way a JSON body carries a surrogate (raw UTF-8 cannot);
a pair of them is one character, one alone is refused."""


def parse_body(raw: bytes, model: type[B]) -> B:
    """``raw`` as ``model``, or a 400 naming the first bad field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise OpenAIError(400, f"the request body is not valid JSON: {error}", None, "invalid_json") from None
    except RecursionError:
        # The decoder recurses per nesting level; no OpenAI field nests this deep.
        raise OpenAIError(400, "the request body nests too deeply", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "the request body must be a JSON object", None, "invalid_json")
    if _MAYBE_SURROGATE.search(raw):
        try:
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            # "\ud800" alone is valid JSON but no Unicode text: nothing downstream can encode it.
            raise OpenAIError(
                400, "the request body has a lone UTF-16 surrogate escape (\\ud800-\\udfff) in a string",
                None, "invalid_json",
            ) from None  # fmt: skip
        except RecursionError:
            raise OpenAIError(400, "the request body nests too deeply", None, "invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise OpenAIError(400, f"{param}: {first['msg']}", param) from None
