"""The gateway as a runtime :class:`~services.runtime.rpc.server.Service`."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Iterator

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh_api.adapter_transfer import ref_by_id, ref_by_name
from mesh_api.upload_wire import WireUploadAdapterStoreStub, read_upload_message
from mesh_api.v1 import (
    adapter_store_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    types_pb2,
)
from services.gateway.adapter_admin import AdapterAdmin
from services.gateway.adapter_catalog import AdapterCatalog
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig
from services.gateway.core import GatewayCore
from services.gateway.etcd_catalog_watch import EtcdCatalogWatch
from services.gateway.http.app import build_app
from services.gateway.http.server import OpenAIHttpServer
from services.gateway.parts import GatewayParts
from services.gateway.quota_metrics import QuotaMetrics
from services.gateway.relay import Relay
from services.gateway.request_metrics import RequestMetrics
from services.gateway.servicer import GatewayServicer
from services.gateway.shared_quota import SharedQuota
from services.gateway.tenant_quota import TenantQuota
from services.model_files.tokenizer_loading import load_tokenizer
from services.runtime.errors import Unavailable
from services.runtime.etcd.discovery import (
    ANSWER_WITHIN_S,
    ChannelPool,
    MemberUnavailable,
    ServiceLocator,
    first_answer,
)
from services.runtime.etcd.membership import MembershipConfig
from services.runtime.metrics import ServiceMetrics
from services.runtime.rpc.method_handlers import add_servicer_with_readers

log = logging.getLogger("loramesh.gateway")

WEIGHTS_FILE = "adapter_model.safetensors"
"""The upload's file whose sha256 the store records (``AdapterInfo.sha256``)."""


class _Unanswered(MemberUnavailable):
    """A member's UNAVAILABLE status, passed on as it is when no member answers."""

    def __init__(self, error: aio.AioRpcError):
        super().__init__(error.details() or error.code().name)
        self.error = error


async def _unless_unavailable(call):
    """``call`` awaited; its UNAVAILABLE status as :class:`_Unanswered` (another member may answer)."""
    try:
        return await call
    except aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            raise _Unanswered(error) from None
        raise


WRITE_PROBE_WITHIN_S = 2.0
"""How long a store replica has to answer the health probe made before a write is sent to it
(:meth:`_Located.write`) when another replica may take the write. The probe is answered from
the replica's event loop, with no disk or etcd behind it: a live replica answers in
milliseconds, a loaded one well within this; one that does not is passed over for this write."""


async def _answers_probe(channel: aio.Channel, within_s: float, what: str) -> None:
    """Returns once the process behind ``channel`` answers a health check (liveness, service
    ""); :class:`_Unanswered` when it does not within ``within_s`` or cannot be reached. A
    server without the health service (UNIMPLEMENTED) answered: it is alive."""
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=within_s)
    except aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:
            return
        if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise MemberUnavailable(f"{what}: no answer to a health probe within {within_s:g} s") from None
        raise _Unanswered(error) from None


class _Replayable:
    """A client stream's messages, kept as they are first read so that a call retried on another
    member sends them all again: each :meth:`replay` reads from the first message. The one-shot
    source is read once, by whichever reader is ahead (a failed call's reader may still take one
    more). The whole stream stays in memory until the call ends (an upload: up to the store's
    size limit)."""

    def __init__(self, source: AsyncIterator):
        self._source = source
        self._read: list = []
        self._ended = False
        self._failed: BaseException | None = None
        self._reading = asyncio.Lock()
        self.replays = 0
        """How many calls were given the stream: more than 1 after a retry."""

    def replay(self) -> AsyncIterator:
        self.replays += 1
        return self._from_start()

    async def read_all(self) -> list:
        """Every message, the source read to its end."""
        while await self._has(len(self._read)):
            pass
        return self._read

    async def _from_start(self) -> AsyncIterator:
        index = 0
        while await self._has(index):
            yield self._read[index]
            index += 1

    async def _has(self, index: int) -> bool:
        """Whether message ``index`` exists, reading the source up to it; raises what it raised."""
        async with self._reading:
            while index >= len(self._read) and not self._ended:
                if self._failed is not None:
                    raise self._failed
                try:
                    self._read.append(await anext(self._source))
                except StopAsyncIteration:
                    self._ended = True
                except BaseException as error:  # cancelled too: the source is over, not ended
                    self._failed = error
                    raise
            return index < len(self._read)


class _Located:
    """A stub for a service found by a :class:`ServiceLocator`: a call that meets UNAVAILABLE is
    made again on another member (:meth:`ServiceLocator.on_live_member`)."""

    def __init__(self, locator: ServiceLocator, channels: ChannelPool, stub_class):
        self._locator = locator
        self._channels = channels
        self._stub_class = stub_class

    async def call(self, method: str, request, answer_within_s: float | None = None, **kwargs):
        """``request``: a message, or a client stream as a :class:`_Replayable`.
        ``answer_within_s``: a read made on another member when this one has not answered in
        that long (:meth:`ServiceLocator.on_answering_member`)."""
        if isinstance(request, Iterator | AsyncIterator):
            raise TypeError("a client stream is sent again on a retry: pass it as a _Replayable")

        async def attempt(address: str, within_s: float | None):
            sent = request.replay() if isinstance(request, _Replayable) else request
            call = _unless_unavailable(getattr(self._stub(address), method)(sent, **kwargs))
            return await first_answer(call, within_s, f"{self._locator.service} at {address}")

        try:
            return await self._locator.on_answering_member(attempt, answer_within_s)
        except _Unanswered as unanswered:
            raise unanswered.error from None

    async def write(self, method: str, request, probe_within_s: float, **kwargs):
        """A call that must not be made twice (an upload, an import, a delete): each member but
        the last one tried must first answer a health probe within ``probe_within_s``, else the
        call goes to another member. A member that never answers (stopped, its host gone
        without a reset) costs that long, not keepalive's 30 s; the call itself is sent to one
        member at a time, so a member that did not answer its probe never got it. The last
        member is sent the call unprobed (the call's own deadline bounds it): a member only
        slow to answer still gets the call when no other answers."""

        async def attempt(address: str, within_s: float | None):
            if within_s is not None:
                await _answers_probe(
                    self._channels.get(address), within_s, f"{self._locator.service} at {address}"
                )
            sent = request.replay() if isinstance(request, _Replayable) else request
            return await _unless_unavailable(getattr(self._stub(address), method)(sent, **kwargs))

        try:
            return await self._locator.on_answering_member(attempt, probe_within_s)
        except _Unanswered as unanswered:
            raise unanswered.error from None

    async def stream(self, method: str, request, refresh: bool):
        """A server-streamed call to the service; ``refresh``: look its address up again first.
        A call that fails UNAVAILABLE before its first message is made on another member."""
        if refresh:
            await self._locator.address(refresh=True)

        async def start(address: str):
            call = getattr(self._stub(address), method)(request)
            return call, await _unless_unavailable(call.read())

        try:
            call, message = await self._locator.on_live_member(start)
        except _Unanswered as unanswered:
            raise unanswered.error from None
        try:
            while message is not aio.EOF:
                yield message
                message = await call.read()
        finally:
            call.cancel()  # the reader went away: the stream ends at the service too

    def _stub(self, address: str):
        return self._stub_class(self._channels.get(address))


class _StoreClient:
    """The adapter store calls the gateway makes. ``catalog``: where the catalog is watched, the
    rows in etcd when the gateway has etcd; else the store's ``WatchAdapters`` stream."""

    def __init__(self, located: _Located, catalog: EtcdCatalogWatch | None):
        self._located = located
        self._catalog = catalog

    async def RegisterAdapter(self, requests: AsyncIterator[bytes]):
        """``requests``: the messages as wire bytes (:mod:`mesh_api.upload_wire`). An upload
        retried after UNAVAILABLE may have been committed by the replica that failed before it
        answered: when the retry meets ALREADY_EXISTS and the name serves these very weights, the
        upload succeeded."""
        upload = _Replayable(requests)
        try:
            return await self._located.write("RegisterAdapter", upload, WRITE_PROBE_WITHIN_S, timeout=300)
        except aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.ALREADY_EXISTS or upload.replays < 2:
                raise
            committed = await self._committed(await upload.read_all())
            if committed is None:
                raise
            return adapter_store_pb2.RegisterAdapterResponse(adapter=committed)

    async def _committed(self, messages: list[bytes]) -> types_pb2.AdapterInfo | None:
        """The adapter the upload's name serves, if its weights are the upload's."""
        header = read_upload_message(messages[0]).header
        if header is None:
            return None
        weights = hashlib.sha256()
        for wire in messages[1:]:
            message = read_upload_message(wire)
            if message.filename == WEIGHTS_FILE:
                weights.update(message.data)
        try:
            adapter = await self.get(header.owner, header.name)
        except aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return None  # deleted since
            raise
        return adapter if adapter.sha256 == weights.hexdigest() else None

    async def ImportAdapter(self, request):
        # The store downloads up to its size limit from S3 or the Hub: an upload's bound.
        return await self._located.write("ImportAdapter", request, WRITE_PROBE_WITHIN_S, timeout=300)

    async def ListAdapters(self, request):
        return await self._located.call("ListAdapters", request, ANSWER_WITHIN_S, timeout=30)

    async def DeleteAdapter(self, request):
        return await self._located.write("DeleteAdapter", request, WRITE_PROBE_WITHIN_S, timeout=30)

    async def SetAdapterPinned(self, request):
        # A pin reads the adapter into the store's RAM (up to its size limit, from disk).
        return await self._located.write("SetAdapterPinned", request, WRITE_PROBE_WITHIN_S, timeout=120)

    def watch(self, refresh: bool):
        if self._catalog is not None:
            return self._catalog.watch(refresh)
        return self._located.stream("WatchAdapters", adapter_store_pb2.WatchAdaptersRequest(), refresh)

    async def close(self) -> None:
        if self._catalog is not None:
            await self._catalog.close()

    async def get(self, owner: str, name: str):
        request = adapter_store_pb2.GetAdapterRequest(ref=ref_by_name(owner, name))
        return await self._located.call("GetAdapter", request, ANSWER_WITHIN_S, timeout=30)

    async def get_id(self, adapter_id: str):
        request = adapter_store_pb2.GetAdapterRequest(ref=ref_by_id(adapter_id))
        return await self._located.call("GetAdapter", request, ANSWER_WITHIN_S, timeout=30)


class GatewayService:
    name = "gateway"
    grpc_service_name = "loramesh.v1.Gateway"
    public_port = True
    """The public API: under TLS its gRPC port asks for no client certificate; tenants
    authenticate by API key (services/runtime/rpc/server.py, services/runtime/security/authorization.py)."""

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
            ),
            EtcdCatalogWatch(MembershipConfig(etcd_endpoints=config.etcd_endpoints, tls=config.tls()))
            if config.etcd_endpoints
            else None,
        )
        self._store = store
        # The tenants' limits hold across the gateways sharing etcd (when some tenant has one, or
        # may have one after an edit of the tenants file, which is read again when it changes).
        shared = (
            SharedQuota(
                MembershipConfig(
                    etcd_endpoints=config.etcd_endpoints, ttl_s=config.lease_ttl_s, tls=config.tls()
                ),
                config.resolved_instance_id("gateway"),
            )
            if config.etcd_endpoints and (keys.quotas.limited or config.api_keys_file)
            else None
        )
        self.core = GatewayCore(config, keys, TenantQuota(keys.quotas, shared=shared))
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
            try:
                return await scheduler.call("Place", request, timeout=10)
            except aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                # No scheduler answered (this gateway is cut off from them): UNAVAILABLE lets the
                # client go on through another gateway; DEADLINE_EXCEEDED reads as its own, final.
                raise Unavailable(f"no scheduler answered Place within 10 s: {error.details()}") from None

        async def report_completion(request: scheduler_pb2.ReportCompletionRequest):
            return await scheduler.call("ReportCompletion", request, timeout=10)

        relay = Relay(place, self.channels, cfg.max_resumes, report_completion)
        self.core.attach(text, relay)
        if self.core.quota.shared is not None:
            await self.core.quota.shared.start()
        self.parts.catalog.start()
        await self.openai.start(build_app(self.parts, self.metrics), cfg.host, cfg.openai_port)

    async def stop(self) -> None:
        await self.parts.catalog.stop()
        await self._store.close()
        await self.openai.stop()
        await self.channels.close()
        if self.core.quota.shared is not None:
            await self.core.quota.shared.close()
        self.core.close()

    def metric_collectors(self) -> tuple[RequestMetrics | QuotaMetrics, ...]:
        """Every generation's latencies, tokens and outcome, per adapter and tenant, and the
        tenants' quotas."""
        return (self.core.metrics, QuotaMetrics(lambda: self.core.quota))

    def load_report(self) -> dict:
        """Its chat template renders, running and waiting (gauges ``loramesh_gateway_*``)."""
        renderer = self.core.renderer
        return {
            "chat_template_renders": renderer.rendering,
            "chat_template_renders_waiting": renderer.waiting,
        }
