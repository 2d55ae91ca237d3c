"""The models ``/v1/models`` serves: the base model and every adapter a tenant may use, as
OpenAI's model objects.

Listings name a tenant's own adapters by ``name`` alone; retrieving one by ``owner/name``
answers the same object (:mod:`services.gateway.http.model_names`).
"""

from __future__ import annotations

import time
from typing import Protocol

from grpc import aio

from services.gateway.adapter_reference import Named, model_id
from services.gateway.http.errors import error_body
from services.gateway.http.model_names import model_not_found
from services.gateway.parts import GatewayParts
from services.runtime.errors import DomainError

#: Statuses of a lookup that mean "no such model for this caller" when retrieving one: missing
#: (404, another tenant's private adapter included), a refusal of access (403), a malformed
#: reference (400: ``a/b/c`` names nothing).
_NOT_VISIBLE = frozenset({400, 403, 404})


class _Registered(Named, Protocol):
    @property
    def created_s(self) -> int: ...


class ModelObjects:
    """OpenAI's model objects for one gateway."""

    def __init__(self, parts: GatewayParts):
        self.core, self.catalog = parts.core, parts.catalog
        self.started = int(time.time())

    def _base_object(self) -> dict:
        base = self.core.base_model
        return {"id": base, "object": "model", "created": self.started, "owned_by": "loramesh",
                "root": base, "parent": None}  # fmt: skip

    def _adapter_object(self, tenant: str, adapter: _Registered) -> dict:
        name = model_id(tenant, adapter)
        return {"id": name, "object": "model", "created": adapter.created_s,
                "owned_by": adapter.owner, "root": name, "parent": self.core.base_model}  # fmt: skip

    async def models(self, tenant: str) -> list[dict]:
        """Every model ``tenant`` may use: the base model first, then the adapters in
        registration order (from the catalog's watched index)."""
        adapters = await self.catalog.usable(tenant)
        return [self._base_object(), *(self._adapter_object(tenant, a) for a in adapters)]

    async def model(self, tenant: str, model: str) -> dict:
        """The model object ``model`` names; 404 when there is none ``tenant`` may see."""
        if model == self.core.base_model:
            return self._base_object()
        try:
            adapter = await self.catalog.resolve(tenant, model)
        except (DomainError, aio.AioRpcError) as error:
            if error_body(error).status not in _NOT_VISIBLE:
                raise
            raise model_not_found(model, "model") from None
        if adapter is None:  # "/v1/models/": no name, no model
            raise model_not_found(model, "model")
        return self._adapter_object(tenant, adapter)
