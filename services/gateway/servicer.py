"""``loramesh.v1.Gateway``: proto <-> the gateway's parts (:mod:`services.gateway.parts`), nothing more."""

from __future__ import annotations

from grpc import aio

from mesh_api.v1 import adapter_store_pb2, gateway_pb2, gateway_pb2_grpc, types_pb2
from services.gateway.adapter_reference import model_id
from services.gateway.continuation import Delivered
from services.gateway.parts import GatewayParts


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, parts: GatewayParts):
        self.core, self.catalog, self.admin = parts.core, parts.catalog, parts.admin

    def _tenant(self, context: aio.ServicerContext) -> str:
        return self.core.tenant(dict(context.invocation_metadata() or ()).get("authorization", ""))

    async def Generate(self, request: gateway_pb2.GenerateTextRequest, context):
        tenant = self._tenant(context)
        async for reply in self.core.generate(
            tenant,
            await self.core.tokenize(request.prompt),
            await self.catalog.resolve(tenant, request.adapter),
            request.sampling,
            request.first_token_deadline_ms,
            _delivered(request.continuation),
            request.cache_salt,
        ):
            yield reply

    async def Chat(self, request: gateway_pb2.ChatRequest, context):
        tenant = self._tenant(context)
        adapter = await self.catalog.resolve(tenant, request.adapter)
        prompt_ids = await self.core.chat_prompt(
            tenant, [(m.role, m.content) for m in request.messages], adapter=adapter
        )
        async for reply in self.core.generate(
            tenant,
            prompt_ids,
            adapter,
            self.core.chat_sampling(request.sampling),
            request.first_token_deadline_ms,
            _delivered(request.continuation),
            request.cache_salt,
        ):
            yield reply

    async def UploadAdapter(self, request_iterator, context):
        return await self.admin.upload_adapter(self._tenant(context), request_iterator)

    async def ImportAdapter(self, request: adapter_store_pb2.ImportAdapterRequest, context):
        return await self.admin.import_adapter(self._tenant(context), request)

    async def ListAdapters(self, request: adapter_store_pb2.ListAdaptersRequest, context):
        return await self.catalog.page(self._tenant(context), request)

    async def GetAdapter(self, request: gateway_pb2.GatewayAdapterRequest, context):
        return await self.catalog.info(self._tenant(context), request.adapter)

    async def DeleteAdapter(self, request: gateway_pb2.GatewayAdapterRequest, context):
        return await self.admin.delete_adapter(self._tenant(context), request.adapter)

    async def SetAdapterPinned(self, request: gateway_pb2.GatewayPinRequest, context):
        return await self.admin.set_adapter_pinned(self._tenant(context), request.adapter, request.pinned)

    async def ListModels(self, request, context):
        tenant = self._tenant(context)
        models = [gateway_pb2.ModelInfo(id="", owner="", base_model=self.core.base_model, is_base=True)]
        for a in await self.catalog.usable(tenant):
            models.append(
                gateway_pb2.ModelInfo(
                    id=model_id(tenant, a),
                    owner=a.owner,
                    base_model=a.base_model,
                    rank=a.max_rank,
                    visibility=types_pb2.VISIBILITY_PUBLIC if a.public else types_pb2.VISIBILITY_PRIVATE,
                )
            )
        return gateway_pb2.ListModelsResponse(models=models)


def _delivered(continuation: gateway_pb2.Continuation) -> Delivered:
    return Delivered(tuple(continuation.token_ids), continuation.text)
