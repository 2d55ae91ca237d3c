"""What the gateway's front ends (the gRPC servicer, the HTTP dialects) call: one of each."""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.adapter_admin import AdapterAdmin
from services.gateway.adapter_catalog import AdapterCatalog
from services.gateway.core import GatewayCore


@dataclass(frozen=True)
class GatewayParts:
    """The gateway's domain objects, shared by every front end."""

    core: GatewayCore
    """Generation: API key → tenant, prompts, limits, placement and relay."""
    catalog: AdapterCatalog
    """Which adapter a request names (resolved once per request) and which a tenant may list."""
    admin: AdapterAdmin
    """Adapter writes: upload, import, load, delete, pin."""
