"""What the gateway's tests build it from: an adapter store in memory, and the gateway's parts
(core, catalog, admin) around a store."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from mesh_api.v1 import adapter_store_pb2, types_pb2
from services.gateway.adapter_admin import AdapterAdmin
from services.gateway.adapter_catalog import AdapterCatalog
from services.gateway.adapter_reference import missing_adapter
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig
from services.gateway.core import GatewayCore
from services.gateway.parts import GatewayParts
from services.gateway.relay import Relay
from services.model_files.tokenizer_loading import TokenizerBundle


@dataclass
class InMemoryStore:
    """The adapter store reads the gateway makes, over a list of adapters."""

    adapters: list[types_pb2.AdapterInfo] = field(default_factory=list)

    async def ListAdapters(self, request: adapter_store_pb2.ListAdaptersRequest):
        return adapter_store_pb2.ListAdaptersResponse(
            adapters=[
                a
                for a in self.adapters
                if a.owner == request.owner
                or (request.include_public and a.visibility == types_pb2.VISIBILITY_PUBLIC)
            ]
        )

    async def watch(self, refresh: bool):
        """The store's catalog watch: every adapter, then no change."""
        yield adapter_store_pb2.WatchAdaptersResponse(upserted=self.adapters, synced=True)
        await asyncio.Event().wait()

    async def get(self, owner: str, name: str) -> types_pb2.AdapterInfo:
        for a in self.adapters:
            if (a.owner, a.name) == (owner, name):
                return a
        raise missing_adapter(owner, name)  # the store's own words


def gateway_parts(
    keys: str,
    store,
    text: TokenizerBundle | None = None,
    relay: Relay | None = None,
    config: GatewayConfig | None = None,
) -> GatewayParts:
    """A gateway's parts over ``store`` (``key=tenant,...`` API keys), attached to ``text`` and
    ``relay`` when ``text`` is given."""
    config = config or GatewayConfig()
    core = GatewayCore(config, ApiKeys.from_config(keys, ""))
    if text is not None:
        core.attach(text, relay)
    catalog = AdapterCatalog(store)
    return GatewayParts(core, catalog, AdapterAdmin(store, catalog, config.adapter_load_dirs))
