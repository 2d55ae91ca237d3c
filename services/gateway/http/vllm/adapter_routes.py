"""vLLM's adapter loading: ``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``: an
``s3://``, ``hf://`` or ``file://`` URI the store imports, or a directory on the gateway's
machine under ``--adapter-load-dirs``; a name already loaded is refused unless
``"load_inplace": true``, which publishes the content as the name's next version) and
``POST /v1/unload_lora_adapter`` (``{"lora_name"}``: deletes it), as the caller's tenant,
answered in vLLM's plain-text words (:mod:`services.gateway.adapter_admin`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from services.gateway.http.reading import parse_body, read_body, tenant
from services.gateway.parts import GatewayParts


class _Body(BaseModel):
    # Unknown fields are ignored, as vLLM does: clients add fields faster than servers.
    model_config = ConfigDict(extra="ignore")


class LoadLoraAdapterBody(_Body):
    """vLLM's ``POST /v1/load_lora_adapter``."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    """A name already loaded gets this content as its next version instead of a refusal."""


class UnloadLoraAdapterBody(_Body):
    """vLLM's ``POST /v1/unload_lora_adapter``."""

    lora_name: str


class AdapterRoutes:
    """Handlers bound to one gateway's parts."""

    def __init__(self, parts: GatewayParts):
        self.core, self.admin = parts.core, parts.admin

    async def load_lora_adapter(self, request: Request) -> Response:
        caller = tenant(self.core, request)
        body = parse_body(await read_body(request.stream()), LoadLoraAdapterBody)
        await self.admin.load_adapter(caller, body.lora_name, body.lora_path, inplace=body.load_inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        caller = tenant(self.core, request)
        body = parse_body(await read_body(request.stream()), UnloadLoraAdapterBody)
        await self.admin.delete_adapter(caller, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    def routes(self) -> list[Route]:
        return [
            Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
        ]
