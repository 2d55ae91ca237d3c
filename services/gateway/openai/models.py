"""The models the HTTP API serves: the base model and every adapter a tenant may use, as
OpenAI's model objects, and which adapter a request names.

A model is named by the base model's id, or by an adapter's ``name`` (the caller's own) or
``owner/name`` (any adapter the caller may use, its own included). Listings name a tenant's own
adapters by ``name`` alone; retrieving one by ``owner/name`` answers the same object.
"""

from __future__ import annotations

import time

from grpc import aio

from mesh_api.v1 import types_pb2
from services.gateway.adapter_index import IndexedAdapter
from services.gateway.core import GatewayCore, model_id
from services.gateway.openai.errors import OpenAIError, error_body
from services.runtime.errors import DomainError

#: Statuses of a lookup that mean "no such model for this caller" when retrieving one: missing
#: (404, another tenant's private adapter included), a refusal of access (403), a malformed
#: reference (400: ``a/b/c`` names nothing).
_NOT_VISIBLE = frozenset({400, 403, 404})


def model_not_found(model: str, field: str) -> OpenAIError:
    return OpenAIError(
        404, f"the model {model!r} does not exist or you do not have access to it", field, "model_not_found"
    )


class ModelCatalog:
    """Model objects and adapter references for one core."""

    def __init__(self, core: GatewayCore):
        self.core = core
        self.started = int(time.time())

    def _base_object(self) -> dict:
        base = self.core.base_model
        return {"id": base, "object": "model", "created": self.started, "owned_by": "loramesh",
                "root": base, "parent": None}  # fmt: skip

    def _adapter_object(
        self, tenant: str, adapter: types_pb2.AdapterInfo | IndexedAdapter, created_s: int
    ) -> dict:
        name = model_id(tenant, adapter)
        return {"id": name, "object": "model", "created": created_s,
                "owned_by": adapter.owner, "root": name, "parent": self.core.base_model}  # fmt: skip

    async def models(self, tenant: str) -> list[dict]:
        """Every model ``tenant`` may use: the base model first, then the adapters in
        registration order (from the gateway's index of the catalog)."""
        adapters = await self.core.usable_adapters(tenant)
        return [self._base_object(), *(self._adapter_object(tenant, a, a.created_s) for a in adapters)]

    async def model(self, tenant: str, model: str) -> dict:
        """The model object ``model`` names; 404 when there is none ``tenant`` may see."""
        if model == self.core.base_model:
            return self._base_object()
        try:
            info = await self.core.get_adapter(tenant, model)
        except (DomainError, aio.AioRpcError) as error:
            if error_body(error).status not in _NOT_VISIBLE:
                raise
            raise model_not_found(model, "model") from None
        return self._adapter_object(tenant, info, info.created_unix_ms // 1000)

    async def adapter(self, tenant: str, model: str, field: str = "model") -> str:
        """The adapter a request's ``field`` names ("" for the base model, or for no name);
        404 naming ``field`` when there is none (another tenant's private adapter included: the
        core answers it as missing), 400 naming it when ``model`` is malformed."""
        if not model or model == self.core.base_model:
            return ""
        try:
            await self.core.resolve_adapter(tenant, model)
        except (DomainError, aio.AioRpcError) as error:
            refusal = error_body(error)
            if refusal.status == 404:
                raise model_not_found(model, field) from None
            if refusal.status == 400:
                raise OpenAIError(400, refusal.message, field) from None
            raise
        return model
