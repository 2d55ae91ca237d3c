"""The OpenAI-compatible routes: HTTP <-> the gateway's core, nothing more; and the app on the
OpenAI port, which also serves vLLM's server routes (:mod:`.server_routes`), vLLM's
``/tokenize`` and ``/detokenize`` (:mod:`.tokenize_routes`) and LoRAX's REST API
(:mod:`.lorax_routes`).

``model`` is the base model's id or an adapter (``name`` or ``owner/name``). A request's
choices are ``n`` generations per prompt; with a ``seed``, choice ``j`` of a prompt uses
``seed + j`` so the choices differ but the request stays reproducible.
"""

from __future__ import annotations

import contextlib
import functools

from grpc import aio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from mesh_api.v1 import types_pb2
from services.gateway.core import GatewayCore
from services.gateway.openai.choices import StartedChoice, close_choices, merged, start_choices
from services.gateway.openai.disconnect import ClientDisconnected, EventStreamResponse, unless_disconnected
from services.gateway.openai.errors import OpenAIError, error_body, handle_error
from services.gateway.openai.lorax_routes import LoraxRoutes
from services.gateway.openai.models import ModelCatalog
from services.gateway.openai.requests import (
    ChatCompletionBody,
    CompletionBody,
    LoadLoraAdapterBody,
    UnloadLoraAdapterBody,
    parse_body,
    read_body,
)
from services.gateway.openai.responses import (
    SSE_DONE,
    ChoiceText,
    ResponseShape,
    finish_reason,
    sse,
    usage,
)
from services.gateway.openai.server_routes import server_routes
from services.gateway.openai.tokenize_routes import TokenizeRoutes
from services.gateway.tool_calls import ToolCallStream
from services.runtime.errors import DomainError
from services.runtime.metrics import ServiceMetrics


def _seeded(sampling: types_pb2.SamplingParams, choice: int) -> types_pb2.SamplingParams:
    if choice == 0 or not sampling.HasField("seed"):
        return sampling
    seeded = types_pb2.SamplingParams()
    seeded.CopyFrom(sampling)
    seeded.seed = (sampling.seed + choice) % 2**64
    return seeded


class OpenAIRoutes:
    """Handlers bound to one core."""

    def __init__(self, core: GatewayCore, catalog: ModelCatalog):
        self.core = core
        self.catalog = catalog

    def _tenant(self, request: Request) -> str:
        return self.core.tenant(request.headers.get("authorization", ""))

    async def completions(self, request: Request) -> Response:
        tenant = self._tenant(request)
        body = parse_body(await read_body(request.stream()), CompletionBody)
        body.check()
        adapter = await self.catalog.adapter(tenant, body.model)
        prompts = [self.core.encode(p) if isinstance(p, str) else p for p in body.prompts()]
        sampling = body.sampling()
        jobs = [(ids, _seeded(sampling, j)) for ids in prompts for j in range(body.n)]
        shape = ResponseShape(
            body.model, chat=False, return_token_ids=body.return_token_ids, token_bytes=self.core.token_bytes
        )
        prompt_tokens = sum(len(ids) for ids in prompts)  # once per prompt however many choices, as OpenAI
        return await self._answer(request, tenant, adapter, jobs, prompt_tokens, shape, body)

    async def chat_completions(self, request: Request) -> Response:
        tenant = self._tenant(request)
        body = parse_body(await read_body(request.stream()), ChatCompletionBody)
        body.check()
        adapter = await self.catalog.adapter(tenant, body.model)
        tools = body.tool_request()
        template = await self.core.chat_template(tenant, adapter, with_tools=tools is not None)
        prompt_ids = self.core.chat_prompt(body.chat_messages(), chat_template=template, tools=tools)
        sampling = self.core.chat_sampling(body.sampling())
        jobs = [(prompt_ids, _seeded(sampling, j)) for j in range(body.n)]
        shape = ResponseShape(
            body.model,
            chat=True,
            return_token_ids=body.return_token_ids,
            token_bytes=self.core.token_bytes,
            tools=tools,
        )
        return await self._answer(request, tenant, adapter, jobs, len(prompt_ids), shape, body)

    async def _answer(
        self,
        request: Request,
        tenant: str,
        adapter: str,
        jobs: list[tuple[list[int], types_pb2.SamplingParams]],
        prompt_tokens: int,
        shape: ResponseShape,
        body: CompletionBody | ChatCompletionBody,
    ) -> Response:
        """Start every choice (refusals surface here, before any byte is sent), then answer."""
        deadline_ms = body.deadline_ms()
        generations = [
            self.core.generate(tenant, ids, adapter, sampling, deadline_ms) for ids, sampling in jobs
        ]
        choices = await unless_disconnected(request.receive, start_choices(generations))
        if body.stream:
            events = self._events(choices, shape, prompt_tokens, body.include_usage)
            return EventStreamResponse(events, on_close=functools.partial(close_choices, choices))
        try:
            whole = await unless_disconnected(request.receive, self._collect(choices, shape, prompt_tokens))
        finally:
            await close_choices(choices)
        return JSONResponse(whole)

    async def _collect(self, choices: list[StartedChoice], shape: ResponseShape, prompt_tokens: int) -> dict:
        texts = [ChoiceText() for _ in choices]
        completion_tokens = 0
        async with contextlib.aclosing(merged(choices)) as replies:
            async for index, reply in replies:
                texts[index].text.append(reply.text)
                texts[index].token_ids += reply.token_ids
                texts[index].logprobs += reply.logprobs
                if reply.finish_reason:
                    texts[index].finish_reason = finish_reason(reply.finish_reason)
                    completion_tokens += reply.usage.completion_tokens
        return shape.response(texts, usage(prompt_tokens, completion_tokens))

    async def _events(self, choices: list[StartedChoice], shape: ResponseShape, prompt_tokens: int,
                      include_usage: bool):  # fmt: skip
        if shape.chat:
            for choice in choices:
                yield sse(shape.role_chunk(choice.index, include_usage))
        completion_tokens = 0
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
                        completion_tokens += reply.usage.completion_tokens
        except (DomainError, aio.AioRpcError) as error:  # after the headers: an error event ends it
            yield error_body(error).sse_event()
        else:
            if include_usage:
                yield sse(shape.usage_chunk(usage(prompt_tokens, completion_tokens)))
        yield SSE_DONE

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": await self.catalog.models(self._tenant(request))})

    async def get_model(self, request: Request) -> Response:
        """``/v1/models/{name}`` and ``/v1/models/{owner}/{name}`` (the path takes the slash)."""
        tenant = self._tenant(request)
        return JSONResponse(await self.catalog.model(tenant, request.path_params["model"]))

    async def load_lora_adapter(self, request: Request) -> Response:
        tenant = self._tenant(request)
        body = parse_body(await read_body(request.stream()), LoadLoraAdapterBody)
        await self.core.load_adapter(tenant, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        tenant = self._tenant(request)
        body = parse_body(await read_body(request.stream()), UnloadLoraAdapterBody)
        await self.core.delete_adapter(tenant, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


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


async def _client_gone(request: Request, error: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


def build_app(core: GatewayCore, metrics: ServiceMetrics | None = None) -> Starlette:
    """The app on the OpenAI port; ``metrics``: the gateway's registry, served at ``/metrics``."""
    catalog = ModelCatalog(core)
    routes = OpenAIRoutes(core, catalog)
    return Starlette(
        routes=[
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/models", routes.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", routes.get_model, methods=["GET"]),
            Route("/v1/load_lora_adapter", routes.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", routes.unload_lora_adapter, methods=["POST"]),
            *server_routes(core, metrics),
            *TokenizeRoutes(core, catalog).routes(),
            *LoraxRoutes(core, catalog).routes(),
        ],
        exception_handlers={
            OpenAIError: handle_error,
            DomainError: handle_error,
            aio.AioRpcError: handle_error,
            HTTPException: handle_error,
            ClientDisconnected: _client_gone,
        },
    )
