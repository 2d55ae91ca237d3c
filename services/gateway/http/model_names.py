"""Which adapter a request names in its ``model`` field (LoRAX: ``adapter_id``): the base
model's id, an adapter's ``name`` (the caller's own) or ``owner/name`` (any adapter the caller may
use, its own included); resolved once per request, then handed on as a
:class:`~services.gateway.adapter_reference.ResolvedAdapter`."""

from __future__ import annotations

from grpc import aio

from services.gateway.adapter_reference import ResolvedAdapter
from services.gateway.http.errors import OpenAIError, error_body
from services.gateway.parts import GatewayParts
from services.runtime.errors import DomainError


def model_not_found(model: str, field: str) -> OpenAIError:
    return OpenAIError(
        404, f"the model {model!r} does not exist or you do not have access to it", field, "model_not_found"
    )


async def requested_adapter(
    parts: GatewayParts, tenant: str, model: str, field: str = "model"
) -> ResolvedAdapter | None:
    """The adapter a request's ``field`` names (None for the base model, or for no name);
    404 naming ``field`` when there is none (another tenant's private adapter included: the
    catalog answers it as missing), 400 naming it when ``model`` is malformed."""
    if not model or model == parts.core.base_model:
        return None
    try:
        return await parts.catalog.resolve(tenant, model)
    except (DomainError, aio.AioRpcError) as error:
        refusal = error_body(error)
        if refusal.status == 404:
            raise model_not_found(model, field) from None
        if refusal.status == 400:
            raise OpenAIError(400, refusal.message, field) from None
        raise
