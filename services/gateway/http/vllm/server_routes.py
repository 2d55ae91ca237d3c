"""The server routes vLLM's OpenAI server has beside ``/v1``, for the probes, scrapers and
tools built against it: ``GET /health`` (200, empty body), ``GET|POST /ping`` (SageMaker's
health check, the same), ``GET /version`` (``{"version": ...}``), ``GET /metrics``
(Prometheus text) and ``GET /openapi.json`` (every route's OpenAPI description,
:mod:`.openapi`). Like vLLM's, they need no API key.

``/metrics`` serves the gateway's own registry, the one its HTTP side port serves, so the same
series can be scraped from either port.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mesh_api.version import VERSION
from services.gateway.core import GatewayCore
from services.gateway.http.openapi import openapi_route
from services.runtime.metrics import ServiceMetrics


def server_routes(core: GatewayCore, metrics: ServiceMetrics | None) -> list[Route]:
    """The routes; ``metrics`` None (the HTTP API run without its service host): no ``/metrics``."""

    async def health(request: Request) -> Response:
        # 503 before the core has its tokenizer and clients (vLLM: while its engine is not up).
        return Response(status_code=200 if core.ready else 503)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/version", version, methods=["GET"]),
        openapi_route(),
    ]
    if metrics is not None:

        async def exposition(request: Request) -> Response:
            return Response(await metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

        routes.append(Route("/metrics", exposition, methods=["GET"]))
    return routes
