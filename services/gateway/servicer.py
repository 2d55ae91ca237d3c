"""``loramesh.v1.Gateway``: authenticate, resolve the adapter, tokenize, relay; adapter
management passed through to the adapter store with the caller's tenant as owner."""

from __future__ import annotations

import uuid

from grpc import aio

from loramesh.v1 import adapter_store_pb2, gateway_pb2, gateway_pb2_grpc, types_pb2
from services.adapter_store.client import ref_by_name
from services.gateway.adapter_access import AdapterAccess, split_reference
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig
from services.gateway.relay import Relay, RelayRequest
from services.gpu_worker.model.tokenizer import Tokenizer
from services.gpu_worker.sampling_proto import sampling_from_proto
from services.runtime.errors import InvalidArgument, PermissionDenied, Unavailable

ROLES = ("system", "user", "assistant")


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Serves RPCs once :meth:`attach` has given it the tokenizer and its clients."""

    def __init__(self, config: GatewayConfig, keys: ApiKeys):
        self.config = config
        self.keys = keys
        self._ready = False

    def attach(
        self, tokenizer: Tokenizer, relay: Relay, access: AdapterAccess, store, base_model: str
    ) -> None:
        self.tokenizer, self.relay, self.access, self.store, self.base_model = (
            tokenizer, relay, access, store, base_model,
        )  # fmt: skip
        self._ready = True

    def _tenant(self, context: aio.ServicerContext) -> str:
        if not self._ready:
            raise Unavailable("the gateway is starting")
        return self.keys.tenant_for(context.invocation_metadata())

    def _sampling(self, requested: types_pb2.SamplingParams) -> types_pb2.SamplingParams:
        sampling = types_pb2.SamplingParams()
        sampling.CopyFrom(requested)
        sampling.max_tokens = requested.max_tokens or self.config.default_max_tokens
        if sampling.max_tokens > self.config.max_tokens_limit:
            raise InvalidArgument(
                f"sampling.max_tokens {sampling.max_tokens} is above the limit {self.config.max_tokens_limit}"
            )
        sampling_from_proto(sampling).validate()  # the worker's own ranges, checked before placing
        if any(t >= self.tokenizer.vocab_size for t in sampling.stop_token_ids):
            raise InvalidArgument("sampling.stop_token_ids must be token ids of the model's vocabulary")
        return sampling

    async def _relay(self, tenant: str, prompt_ids: list[int], adapter: str, sampling, deadline_ms: float):
        if not prompt_ids:
            raise InvalidArgument("prompt is empty")
        if len(prompt_ids) > self.config.max_prompt_tokens:
            raise InvalidArgument(
                f"prompt has {len(prompt_ids)} tokens; the limit is {self.config.max_prompt_tokens}"
            )
        adapter_id = (await self.access.resolve(tenant, adapter)).id if adapter else ""
        request = RelayRequest(
            request_id=uuid.uuid4().hex[:16],
            prompt_ids=prompt_ids,
            adapter_id=adapter_id,
            sampling=self._sampling(sampling),
            first_token_deadline_ms=deadline_ms or self.config.default_first_token_deadline_ms,
        )
        async for reply in self.relay.stream(request):
            yield reply

    async def Generate(self, request: gateway_pb2.GenerateTextRequest, context):
        tenant = self._tenant(context)
        prompt_ids = self.tokenizer.encode(request.prompt)
        async for reply in self._relay(
            tenant, prompt_ids, request.adapter, request.sampling, request.first_token_deadline_ms
        ):
            yield reply

    async def Chat(self, request: gateway_pb2.ChatRequest, context):
        tenant = self._tenant(context)
        if not request.messages:
            raise InvalidArgument("messages is empty")
        for i, message in enumerate(request.messages):
            if message.role not in ROLES:
                raise InvalidArgument(
                    f"messages[{i}].role must be one of {', '.join(ROLES)}, got {message.role!r}"
                )
        text = self.tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in request.messages], add_generation_prompt=True
        )
        sampling = types_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        if not sampling.ignore_eos:  # the template's end-of-turn tokens end a chat reply
            sampling.stop_token_ids.extend(
                t for t in self.tokenizer.eos_token_ids if t not in sampling.stop_token_ids
            )
        async for reply in self._relay(
            tenant, self.tokenizer.encode(text), request.adapter, sampling, request.first_token_deadline_ms
        ):
            yield reply

    async def UploadAdapter(self, request_iterator, context):
        tenant = self._tenant(context)

        async def as_tenant():
            first = True
            async for message in request_iterator:
                if first and message.WhichOneof("item") == "header":
                    message.header.owner = tenant  # the caller's tenant owns what it uploads
                first = False
                yield message

        reply = await self.store.RegisterAdapter(as_tenant())
        self.access.forget(tenant, reply.adapter.name)
        return reply

    async def ListAdapters(self, request: adapter_store_pb2.ListAdaptersRequest, context):
        tenant = self._tenant(context)
        if request.owner and request.owner != tenant:
            raise PermissionDenied("a tenant may list only its own adapters (and public ones)")
        forwarded = adapter_store_pb2.ListAdaptersRequest()
        forwarded.CopyFrom(request)
        forwarded.owner, forwarded.include_public = tenant, True
        return await self.store.ListAdapters(forwarded)

    async def GetAdapter(self, request: gateway_pb2.GatewayAdapterRequest, context):
        tenant = self._tenant(context)
        return await self.access.resolve(tenant, request.adapter)

    async def DeleteAdapter(self, request: gateway_pb2.GatewayAdapterRequest, context):
        tenant = self._tenant(context)
        owner, name = split_reference(tenant, request.adapter)
        if owner != tenant:
            raise PermissionDenied(f"adapter {request.adapter!r} belongs to tenant {owner!r}")
        reply = await self.store.DeleteAdapter(
            adapter_store_pb2.DeleteAdapterRequest(ref=ref_by_name(owner, name))
        )
        self.access.forget(owner, name)
        return reply

    async def ListModels(self, request, context):
        tenant = self._tenant(context)
        models = [gateway_pb2.ModelInfo(id="", owner="", base_model=self.base_model, is_base=True)]
        token = ""
        while True:
            page = await self.store.ListAdapters(
                adapter_store_pb2.ListAdaptersRequest(
                    owner=tenant, include_public=True, page_size=1000, page_token=token
                )
            )
            for a in page.adapters:
                models.append(
                    gateway_pb2.ModelInfo(
                        id=a.name if a.owner == tenant else f"{a.owner}/{a.name}",
                        owner=a.owner,
                        base_model=a.base_model,
                        rank=a.max_rank,
                        visibility=a.visibility,
                    )
                )
            token = page.next_page_token
            if not token:
                return gateway_pb2.ListModelsResponse(models=models)
