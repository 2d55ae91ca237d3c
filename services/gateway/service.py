"""The gateway as a runtime :class:`~services.runtime.rpc.server.Service`."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc import aio

from mesh_api.adapter_transfer import ref_by_name
from mesh_api.upload_wire import WireUploadAdapterStoreStub, read_upload_message
from mesh_api.v1 import (
    adapter_store_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.gateway.adapter_admin import AdapterAdmin
from services.gateway.adapter_catalog import AdapterCatalog
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig
from services.gateway.core import GatewayCore
from services.gateway.http.app import build_app
from services.gateway.http.server import OpenAIHttpServer
from services.gateway.parts import GatewayParts
from services.gateway.relay import Relay
from services.gateway.servicer import GatewayServicer
from services.model_files.tokenizer_loading import load_tokenizer
from services.runtime.etcd.discovery import ChannelPool, ServiceLocator
from services.runtime.metrics import ServiceMetrics
from services.runtime.rpc.method_handlers import add_servicer_with_readers

log = logging.getLogger("loramesh.gateway")


class _Located:
    """A stub for a service found by a :class:`ServiceLocator`; re-resolved after UNAVAILABLE."""

    def __init__(self, locator: ServiceLocator, channels: ChannelPool, stub_class):
        self._locator = locator
        self._channels = channels
        self._stub_class = stub_class

    async def call(self, method: str, request, **kwargs):
        for attempt in range(2):
            address = await self._locator.address(refresh=attempt > 0)
            stub = self._stub_class(self._channels.get(address))
            try:
                return await getattr(stub, method)(request, **kwargs)
            except aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or attempt or self._locator.fixed:
                    raise
        raise AssertionError("unreachable")

    async def stream(self, method: str, request, refresh: bool):
        """A server-streamed call to the service; ``refresh``: look its address up again first."""
        address = await self._locator.address(refresh=refresh)
        async for message in getattr(self._stub_class(self._channels.get(address)), method)(request):
            yield message


class _StoreClient:
    """The adapter store calls the gateway makes."""

    def __init__(self, located: _Located):
        self._located = located

    async def RegisterAdapter(self, requests):
        """``requests``: the messages as wire bytes (:mod:`mesh_api.upload_wire`)."""
        return await self._located.call("RegisterAdapter", requests, timeout=300)

    async def ImportAdapter(self, request):
        # The store downloads up to its size limit from S3 or the Hub: an upload's bound.
        return await self._located.call("ImportAdapter", request, timeout=300)

    async def ListAdapters(self, request):
        return await self._located.call("ListAdapters", request, timeout=30)

    async def DeleteAdapter(self, request):
        return await self._located.call("DeleteAdapter", request, timeout=30)

    async def SetAdapterPinned(self, request):
        # A pin reads the adapter into the store's RAM (up to its size limit, from disk).
        return await self._located.call("SetAdapterPinned", request, timeout=120)

    def watch(self, refresh: bool):
        return self._located.stream("WatchAdapters", adapter_store_pb2.WatchAdaptersRequest(), refresh)

    async def get(self, owner: str, name: str):
        request = adapter_store_pb2.GetAdapterRequest(ref=ref_by_name(owner, name))
        return await self._located.call("GetAdapter", request, timeout=30)


class GatewayService:
    name = "gateway"
    grpc_service_name = "loramesh.v1.Gateway"

    def __init__(self, config: GatewayConfig):
        self.config = config
        keys = ApiKeys.from_config(config.api_keys, config.api_keys_file)
        if not len(keys):
            log.warning("no API keys configured: every request will be refused (UNAUTHENTICATED)")
        self.channels = ChannelPool(config.tls())
        store = _StoreClient(
            _Located(
                ServiceLocator("adapter_store", config.adapter_store, config.etcd_endpoints, config.tls()),
                self.channels,
                WireUploadAdapterStoreStub,
            )
        )
        self.core = GatewayCore(config, keys)
        catalog = AdapterCatalog(store, config.adapter_cache_s, config.adapter_access_cache)
        self.parts = GatewayParts(self.core, catalog, AdapterAdmin(store, catalog, config.adapter_load_dirs))
        self.servicer = GatewayServicer(self.parts)
        self.openai = OpenAIHttpServer(config.grace_s, config.tls())  # HTTPS only with TLS on
        self.metrics: ServiceMetrics | None = None

    def serve_metrics(self, metrics: ServiceMetrics) -> None:
        """The service host's registry, which the OpenAI port serves at ``/metrics`` too."""
        self.metrics = metrics

    def add_to_server(self, server: aio.Server) -> None:
        add_servicer_with_readers(
            server,
            gateway_pb2_grpc.add_GatewayServicer_to_server,
            self.servicer,
            {"UploadAdapter": read_upload_message},
        )

    async def start(self) -> None:
        cfg = self.config
        # The tokenizer alone: the gateway never reads a weight (about 140 GB for a 70B base).
        text = await asyncio.to_thread(load_tokenizer, cfg.model or None)
        scheduler = _Located(
            ServiceLocator("scheduler", cfg.scheduler, cfg.etcd_endpoints, cfg.tls()),
            self.channels,
            scheduler_pb2_grpc.SchedulerStub,
        )

        async def place(request: scheduler_pb2.PlaceRequest) -> scheduler_pb2.PlaceResponse:
            return await scheduler.call("Place", request, timeout=10)

        async def report_completion(request: scheduler_pb2.ReportCompletionRequest):
            return await scheduler.call("ReportCompletion", request, timeout=10)

        relay = Relay(place, self.channels, cfg.max_resumes, report_completion)
        self.core.attach(text, relay)
        self.parts.catalog.start()
        await self.openai.start(build_app(self.parts, self.metrics), cfg.host, cfg.openai_port)

    async def stop(self) -> None:
        await self.parts.catalog.stop()
        await self.openai.stop()
        await self.channels.close()

    def load_report(self) -> dict:
        return {}
