"""OpenAI's routes: HTTP <-> the gateway's parts, nothing more.

``model`` is the base model's id or an adapter (``name`` or ``owner/name``, optionally ``@N`` or
``@sha256:<hex>``), resolved once per request (:mod:`services.gateway.http.model_names`); the
response and each chunk name the version serving it in ``system_fingerprint``. A request's choices are ``n`` generations
per prompt; with a ``seed``, choice ``j`` of a prompt uses ``seed + j`` so the choices differ but
the request stays reproducible.
"""

from __future__ import annotations

import contextlib
import functools

from grpc import aio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mesh_api.v1 import types_pb2
from services.gateway.adapter_reference import ResolvedAdapter
from services.gateway.adapter_version import fingerprint
from services.gateway.http.choices import StartedChoice, close_choices, merged, start_choices
from services.gateway.http.disconnect import EventStreamResponse, unless_disconnected
from services.gateway.http.errors import error_body
from services.gateway.http.events import sse
from services.gateway.http.model_names import requested_adapter
from services.gateway.http.openai.models import ModelObjects
from services.gateway.http.openai.requests import ChatCompletionBody, CompletionBody
from services.gateway.http.openai.responses import (
    SSE_DONE,
    ChoiceText,
    ResponseShape,
    UsageTally,
    finish_reason,
)
from services.gateway.http.reading import parse_body, read_body, tenant
from services.gateway.parts import GatewayParts
from services.gateway.tool_calls import ToolCallStream
from services.runtime.errors import DomainError


def _seeded(sampling: types_pb2.SamplingParams, choice: int) -> types_pb2.SamplingParams:
    if choice == 0 or not sampling.HasField("seed"):
        return sampling
    seeded = types_pb2.SamplingParams()
    seeded.CopyFrom(sampling)
    seeded.seed = (sampling.seed + choice) % 2**64
    return seeded


def _fingerprint(caller: str, adapter: ResolvedAdapter | None) -> str | None:
    """The version serving the request, as the caller names it; None for the base model."""
    return fingerprint(caller, adapter) if adapter is not None else None


class OpenAIRoutes:
    """Handlers bound to one gateway's parts."""

    def __init__(self, parts: GatewayParts):
        self.parts, self.core = parts, parts.core
        self.models = ModelObjects(parts)

    async def completions(self, request: Request) -> Response:
        caller = tenant(self.core, request)
        body = parse_body(await read_body(request.stream()), CompletionBody)
        body.check()
        adapter = await requested_adapter(self.parts, caller, body.model)
        prompts = await self.core.tokenize_each(body.prompts())
        sampling = body.sampling()
        jobs = [(ids, _seeded(sampling, j)) for ids in prompts for j in range(body.n)]
        shape = ResponseShape(
            body.model,
            chat=False,
            return_token_ids=body.return_token_ids,
            token_bytes=self.core.token_bytes,
            system_fingerprint=_fingerprint(caller, adapter),
        )
        prompt_tokens = sum(len(ids) for ids in prompts)  # once per prompt however many choices, as OpenAI
        return await self._answer(request, caller, adapter, jobs, prompt_tokens, shape, body)

    async def chat_completions(self, request: Request) -> Response:
        caller = tenant(self.core, request)
        body = parse_body(await read_body(request.stream()), ChatCompletionBody)
        body.check()
        adapter = await requested_adapter(self.parts, caller, body.model)
        tools = body.tool_request()
        prompt_ids = await self.core.chat_prompt(caller, body.chat_messages(), adapter=adapter, tools=tools)
        sampling = self.core.chat_sampling(body.sampling())
        jobs = [(prompt_ids, _seeded(sampling, j)) for j in range(body.n)]
        shape = ResponseShape(
            body.model,
            chat=True,
            return_token_ids=body.return_token_ids,
            token_bytes=self.core.token_bytes,
            tools=tools,
            system_fingerprint=_fingerprint(caller, adapter),
        )
        return await self._answer(request, caller, adapter, jobs, len(prompt_ids), shape, body)

    async def _answer(
        self,
        request: Request,
        caller: str,
        adapter: ResolvedAdapter | None,
        jobs: list[tuple[list[int], types_pb2.SamplingParams]],
        prompt_tokens: int,
        shape: ResponseShape,
        body: CompletionBody | ChatCompletionBody,
    ) -> Response:
        """Start every choice (refusals surface here, before any byte is sent), then answer."""
        deadline_ms, salt = body.deadline_ms(), body.cache_salt or ""
        generations = [
            self.core.generate(caller, ids, adapter, sampling, deadline_ms, cache_salt=salt)
            for ids, sampling in jobs
        ]
        choices = await unless_disconnected(request.receive, start_choices(generations))
        tally = UsageTally(prompt_tokens, body.n)
        if body.stream:
            events = self._events(choices, shape, tally, body.include_usage)
            return EventStreamResponse(events, on_close=functools.partial(close_choices, choices))
        try:
            whole = await unless_disconnected(request.receive, self._collect(choices, shape, tally))
        finally:
            await close_choices(choices)
        return JSONResponse(whole)

    async def _collect(self, choices: list[StartedChoice], shape: ResponseShape, tally: UsageTally) -> dict:
        texts = [ChoiceText() for _ in choices]
        async with contextlib.aclosing(merged(choices)) as replies:
            async for index, reply in replies:
                texts[index].text.append(reply.text)
                texts[index].token_ids += reply.token_ids
                texts[index].logprobs += reply.logprobs
                if reply.finish_reason:
                    texts[index].finish_reason = finish_reason(reply.finish_reason)
                    tally.add(index, reply.usage)
        return shape.response(texts, tally.usage())

    async def _events(self, choices: list[StartedChoice], shape: ResponseShape, tally: UsageTally,
                      include_usage: bool):  # fmt: skip
        if shape.chat:
            for choice in choices:
                yield sse(shape.role_chunk(choice.index, include_usage))
        calls = [ToolCallStream(shape.tools) for _ in choices] if shape.tools is not None else None
        try:
            async with contextlib.aclosing(merged(choices)) as replies:
                async for index, reply in replies:
                    finish = finish_reason(reply.finish_reason)
                    if calls is not None:
                        for chunk in tool_call_chunks(
                            shape, calls[index], index, reply, finish, include_usage
                        ):
                            yield sse(chunk)
                    elif reply.text or finish or shape.return_token_ids or reply.logprobs:
                        yield sse(
                            shape.delta_chunk(
                                index, reply.text, reply.token_ids, finish, include_usage, reply.logprobs
                            )
                        )
                    if finish:
                        tally.add(index, reply.usage)
        except (DomainError, aio.AioRpcError) as error:  # after the headers: an error event ends it
            yield error_body(error).sse_event()
        else:
            if include_usage:
                yield sse(shape.usage_chunk(tally.usage()))
        yield SSE_DONE

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": await self.models.models(tenant(self.core, request))})

    async def get_model(self, request: Request) -> Response:
        """``/v1/models/{name}`` and ``/v1/models/{owner}/{name}`` (the path takes the slash)."""
        caller = tenant(self.core, request)
        return JSONResponse(await self.models.model(caller, request.path_params["model"]))

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
        ]


def tool_call_chunks(
    shape: ResponseShape,
    calls: ToolCallStream,
    index: int,
    reply,
    finish: str | None,
    include_usage: bool,
) -> list[dict]:
    """The chunks one reply of a chat with tools makes: its text read for tool calls (content,
    or a call's name and then its arguments piece by piece), the finish on the last chunk."""
    deltas = calls.feed(reply.text)
    if finish:
        deltas += calls.finish()
        finish = calls.finish_reason(finish)
    if not deltas and (finish or shape.return_token_ids):
        deltas = [{}]
    return [
        shape.chat_delta_chunk(
            index,
            delta,
            reply.token_ids if k == 0 else (),
            finish if k == len(deltas) - 1 else None,
            include_usage,
        )
        for k, delta in enumerate(deltas)
    ]
