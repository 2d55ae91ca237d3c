"""The app on the gateway's HTTP port: OpenAI's routes (:mod:`.openai`), vLLM's additions
(:mod:`.vllm`) and LoRAX's REST API (:mod:`.lorax`), with every failure answered in OpenAI's
error JSON (LoRAX's routes answer in LoRAX's own)."""

from __future__ import annotations

from grpc import aio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from services.gateway.http.disconnect import ClientDisconnected
from services.gateway.http.errors import OpenAIError, handle_error
from services.gateway.http.lorax.routes import LoraxRoutes
from services.gateway.http.openai.routes import OpenAIRoutes
from services.gateway.http.vllm.adapter_routes import AdapterRoutes
from services.gateway.http.vllm.server_routes import server_routes
from services.gateway.http.vllm.tokenize_routes import TokenizeRoutes
from services.gateway.parts import GatewayParts
from services.runtime.errors import DomainError
from services.runtime.metrics import ServiceMetrics


async def _client_gone(request: Request, error: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


def build_app(parts: GatewayParts, metrics: ServiceMetrics | None = None) -> Starlette:
    """The app; ``metrics``: the gateway's registry, served at ``/metrics``."""
    return Starlette(
        routes=[
            *OpenAIRoutes(parts).routes(),
            *AdapterRoutes(parts).routes(),
            *server_routes(parts.core, metrics),
            *TokenizeRoutes(parts).routes(),
            *LoraxRoutes(parts).routes(),
        ],
        exception_handlers={
            OpenAIError: handle_error,
            DomainError: handle_error,
            aio.AioRpcError: handle_error,
            HTTPException: handle_error,
            ClientDisconnected: _client_gone,
        },
    )
