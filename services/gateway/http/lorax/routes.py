"""LoRAX's REST API on the HTTP port: HTTP <-> the gateway's parts, as the OpenAI routes.

``POST /generate`` answers ``{"generated_text", "details"}`` (``details`` when asked for);
``POST /generate_stream`` streams one server-sent event per token, ``{"token",
"generated_text", "details"}``, the last one with the whole text (and the details when asked
for); ``POST /`` is LoRAX's compatibility route, the one ``lorax-client`` calls: the stream when
the body says ``"stream": true``, else ``/generate``'s answer in a one-element list. Refusals
come before any byte is sent, with their status; a failure after the stream started is an
``{"error", "error_type"}`` event that ends it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable

from grpc import aio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.gateway.adapter_version import fingerprint
from services.gateway.http.choices import Reply, StartedChoice, close_choices, merged, start_choices
from services.gateway.http.disconnect import EventStreamResponse, unless_disconnected
from services.gateway.http.errors import OpenAIError
from services.gateway.http.events import sse
from services.gateway.http.lorax.requests import LoraxGenerateBody
from services.gateway.http.lorax.responses import LoraxShape, details, lorax_error, stream_details
from services.gateway.http.model_names import requested_adapter
from services.gateway.http.reading import parse_body, read_body
from services.gateway.parts import GatewayParts
from services.runtime.errors import DomainError

Handler = Callable[[Request], Awaitable[Response]]


def _lorax_errors(handler: Handler) -> Handler:
    """Refusals in LoRAX's error shape instead of the app's OpenAI one."""

    @functools.wraps(handler)
    async def answer(request: Request) -> Response:
        try:
            return await handler(request)
        except (OpenAIError, DomainError, aio.AioRpcError) as error:
            return lorax_error(error).response()

    return answer


class _Generation:
    """One started generation and what its answer needs."""

    def __init__(self, body: LoraxGenerateBody, shape: LoraxShape, choice: StartedChoice):
        self.body, self.shape, self.choice = body, shape, choice
        params = body.parameters
        self.seed = params.seed if params.samples else None
        self.prefix = body.inputs if params.return_full_text else ""

    async def whole(self) -> dict:
        texts, tokens = [self.prefix], []
        async with contextlib.aclosing(merged([self.choice])) as replies:
            async for _, reply in replies:
                texts.append(reply.text)
                tokens += self.shape.tokens(reply)
                last = reply
        answer = {"generated_text": "".join(texts)}
        if self.body.parameters.details:
            answer["details"] = details(self.shape, last, self.seed, tokens)
        return answer

    async def events(self):
        texts = [self.prefix]
        try:
            async with contextlib.aclosing(merged([self.choice])) as replies:
                async for _, reply in replies:
                    texts.append(reply.text)
                    tokens = self.shape.tokens(reply)
                    if reply.finish_reason and not tokens:
                        tokens = [self.shape.end_marker(reply)]
                    for i, token in enumerate(tokens):
                        ends = bool(reply.finish_reason) and i == len(tokens) - 1
                        yield sse(self._event(token, "".join(texts), reply) if ends else self._event(token))
        except (DomainError, aio.AioRpcError) as error:  # after the headers: an error event ends it
            yield lorax_error(error).sse_event()

    def _event(self, token: dict, text: str | None = None, last: Reply | None = None) -> dict:
        """One stream event; the last one (``last``: the generation's last reply) has the whole
        ``text``, and the details when they were asked for."""
        if last is None:
            return {"token": token, "generated_text": None, "details": None}
        asked = self.body.parameters.details
        return {"token": token, "generated_text": text,
                "details": stream_details(self.shape, last, self.seed) if asked else None}  # fmt: skip


class LoraxRoutes:
    """Handlers bound to one gateway's parts."""

    def __init__(self, parts: GatewayParts):
        self.parts, self.core = parts, parts.core

    async def _start(self, request: Request) -> _Generation:
        """Parse, check, authenticate, resolve the adapter and start the generation: every
        refusal is raised here, before the answer begins."""
        body = parse_body(await read_body(request.stream()), LoraxGenerateBody)
        body.check(self.core.config.max_tokens_limit)
        params = body.parameters
        tenant = self.core.tenant(body.authorization(request.headers.get("authorization", "")))
        adapter = await requested_adapter(self.parts, tenant, params.adapter_id or "", "adapter_id")
        prompt = body.prompt(await self.core.tokenize(body.inputs, field="inputs"))
        generation = self.core.generate(tenant, prompt, adapter, params.sampling())
        [choice] = await unless_disconnected(request.receive, start_choices([generation]))
        shape = LoraxShape(
            self.core.token_bytes,
            self.core.model_tokens.eos_token_ids,
            params.ignore_eos_token,
            alternatives=params.return_k_alternatives is not None,
            adapter_version=fingerprint(tenant, adapter) if adapter is not None else None,
        )
        return _Generation(body, shape, choice)

    async def _whole(self, request: Request, generation: _Generation) -> dict:
        try:
            return await unless_disconnected(request.receive, generation.whole())
        finally:
            await close_choices([generation.choice])

    @staticmethod
    def _stream(generation: _Generation) -> Response:
        return EventStreamResponse(
            generation.events(), on_close=functools.partial(close_choices, [generation.choice])
        )

    async def generate(self, request: Request) -> Response:
        return JSONResponse(await self._whole(request, await self._start(request)))

    async def generate_stream(self, request: Request) -> Response:
        return self._stream(await self._start(request))

    async def compat_generate(self, request: Request) -> Response:
        generation = await self._start(request)
        if generation.body.stream:
            return self._stream(generation)
        return JSONResponse([await self._whole(request, generation)])

    def routes(self) -> list[Route]:
        return [
            Route("/", _lorax_errors(self.compat_generate), methods=["POST"]),
            Route("/generate", _lorax_errors(self.generate), methods=["POST"]),
            Route("/generate_stream", _lorax_errors(self.generate_stream), methods=["POST"]),
        ]
