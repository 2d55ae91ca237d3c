"""What the gateway's tests build it from: an adapter store in memory, the gateway's parts (core,
catalog, admin) around a store, and those parts served over gRPC."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from grpc import aio

from mesh_api.adapter_transfer import ref_by_id, ref_by_name
from mesh_api.v1 import adapter_store_pb2, adapter_store_pb2_grpc, gateway_pb2_grpc, types_pb2
from services.gateway.adapter_admin import AdapterAdmin
from services.gateway.adapter_catalog import AdapterCatalog
from services.gateway.adapter_reference import missing_adapter
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig
from services.gateway.core import GatewayCore
from services.gateway.parts import GatewayParts
from services.gateway.relay import Relay
from services.gateway.servicer import GatewayServicer
from services.gateway.template_renderer import TemplateRenderer
from services.model_files.template_budget import TemplateBudget
from services.model_files.tokenizer_loading import TokenizerBundle
from services.runtime.errors import NotFound
from services.runtime.rpc.interceptors import ServiceInterceptor


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
        """The name's newest version."""
        versions = [a for a in self.adapters if (a.owner, a.name) == (owner, name)]
        if not versions:
            raise missing_adapter(owner, name)  # the store's own words
        return max(versions, key=lambda a: a.version)

    async def get_id(self, adapter_id: str) -> types_pb2.AdapterInfo:
        for a in self.adapters:
            if a.id == adapter_id:
                return a
        raise NotFound(f"adapter {adapter_id!r} not found")


class StubStore:
    """A real store's stub as the gateway's catalog reads it (lookups by name and by id, its
    ``WatchAdapters``); every other call goes to the stub as it is."""

    def __init__(self, stub: adapter_store_pb2_grpc.AdapterStoreStub):
        self._stub = stub

    def __getattr__(self, method: str):
        return getattr(self._stub, method)

    async def get(self, owner: str, name: str) -> types_pb2.AdapterInfo:
        return await self._stub.GetAdapter(adapter_store_pb2.GetAdapterRequest(ref=ref_by_name(owner, name)))

    async def get_id(self, adapter_id: str) -> types_pb2.AdapterInfo:
        return await self._stub.GetAdapter(adapter_store_pb2.GetAdapterRequest(ref=ref_by_id(adapter_id)))

    def watch(self, refresh: bool):
        return self._stub.WatchAdapters(adapter_store_pb2.WatchAdaptersRequest())


@functools.cache
def shared_renderer() -> TemplateRenderer:
    """One template renderer with the default budget for the in-process gateways of a test run:
    its render processes start once, not once per test. Ended when the run ends."""
    renderer = TemplateRenderer(TemplateBudget(), processes=2)
    atexit.register(renderer.close)
    return renderer


def gateway_parts(
    keys: str,
    store,
    text: TokenizerBundle | None = None,
    relay: Relay | None = None,
    config: GatewayConfig | None = None,
    renderer: TemplateRenderer | None = None,
) -> GatewayParts:
    """A gateway's parts over ``store`` (``key=tenant,...`` API keys), attached to ``text`` and
    ``relay`` when ``text`` is given; chat templates render in ``renderer`` (default:
    :func:`shared_renderer`)."""
    config = config or GatewayConfig()
    core = GatewayCore(config, ApiKeys.from_config(keys, ""), renderer=renderer or shared_renderer())
    if text is not None:
        core.attach(text, relay)
    catalog = AdapterCatalog(store)
    return GatewayParts(core, catalog, AdapterAdmin(store, catalog, config.adapter_load_dirs))


@contextlib.asynccontextmanager
async def gateway_grpc(parts: GatewayParts) -> AsyncIterator[gateway_pb2_grpc.GatewayStub]:
    """``parts`` served as ``loramesh.v1.Gateway`` (servicer and interceptor) on loopback; a stub
    on a channel to it."""
    server = aio.server(interceptors=[ServiceInterceptor()])
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(parts), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield gateway_pb2_grpc.GatewayStub(channel)
    finally:
        await server.stop(None)
