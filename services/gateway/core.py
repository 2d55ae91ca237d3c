"""The gateway's one core, shared by its front ends (the gRPC servicer and the OpenAI HTTP API).

API key → tenant, adapter access, chat template, tokenization, request limits, the tenants'
limits on generations in flight and tokens per minute (:mod:`services.gateway.tenant_quota`),
prompt and sampling validation (:mod:`services.runtime.request_validation`, the checks the
workers make too), continuations of streams another gateway broke off
(:mod:`services.gateway.continuation`), placement + relay with resume (which also detokenizes
and honours stop strings), and adapter management passed to the adapter store with the caller's tenant as owner. A front
end only translates its wire format to these calls and their results back; nothing here knows
about a server context or an HTTP request.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence

from mesh_api.adapter_transfer import is_import_uri, read_adapter_dir, ref_by_name
from mesh_api.upload_wire import UploadMessage, header_wire, upload_wire
from mesh_api.v1 import adapter_store_pb2, gateway_pb2, types_pb2
from services.gateway.adapter_access import AdapterAccess, split_reference
from services.gateway.adapter_index import AdapterIndex, IndexedAdapter
from services.gateway.adapter_load_dirs import load_roots, resolve_adapter_dir
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig
from services.gateway.continuation import NOTHING_DELIVERED, Delivered, ModelTokens, resume_point
from services.gateway.relay import Relay, RelayRequest
from services.gateway.tenant_quota import TenantQuota
from services.gateway.tool_calls import ChatMessage, ToolRequest, template_input
from services.model_files.tokenizer import ChatTemplateError
from services.model_files.tokenizer_loading import TokenizerBundle
from services.runtime.errors import InvalidArgument, PermissionDenied, Unavailable
from services.runtime.request_validation import check_first_token_deadline, check_request
from services.runtime.sampling_proto import sampling_from_proto

ROLES = ("system", "user", "assistant", "tool")


class GatewayCore:
    """Serves requests once :meth:`attach` has given it the tokenizer and its clients."""

    def __init__(self, config: GatewayConfig, keys: ApiKeys, quota: TenantQuota | None = None):
        """``quota``: the tenants' limits; None: those of the tenants file (``keys.quotas``)."""
        self.config = config
        self.keys = keys
        self.quota = quota or TenantQuota(keys.quotas)
        self._ready = False

    def attach(self, text: TokenizerBundle, relay: Relay, access: AdapterAccess, store) -> None:
        """``text``: the base model's tokenizer and limits, loaded without its weights."""
        self.tokenizer, self.base_model, self.context_length = (
            text.tokenizer, text.model_name, text.context_length,
        )  # fmt: skip
        self.model_tokens = ModelTokens(
            self.tokenizer.id_to_bytes,
            self.tokenizer.vocab_size,
            frozenset(self.tokenizer.eos_token_ids),
            self.context_length,
        )
        self.relay, self.access, self.store = relay, access, store
        self.adapter_index = AdapterIndex(store)
        """Every adapter, from the store's catalog watch (started by the gateway service, or by
        the first listing)."""
        self._ready = True

    @property
    def ready(self) -> bool:
        """Attached: requests can be served."""
        return self._ready

    # -- who is asking ------------------------------------------------------------------------

    def tenant(self, authorization: str) -> str:
        """The tenant of an ``Authorization: Bearer <key>`` header value."""
        if not self._ready:
            raise Unavailable("the gateway is starting")
        return self.keys.tenant_for(authorization)

    # -- prompts ------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``add_special_tokens``: what the tokenizer's post-processor adds (a BOS for some models)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (names tokens in OpenAI's ``logprobs``)."""
        return self.tokenizer.id_to_bytes(token_id)

    def chat_prompt(
        self,
        messages: Sequence[tuple[str, str] | ChatMessage],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        *,
        chat_template: str | None = None,
        tools: ToolRequest | None = None,
    ) -> list[int]:
        """Messages (``(role, content)`` pairs, or :class:`ChatMessage` with tool calls and
        results) through the chat template, tokenized; the prompt of a reply unless
        ``add_generation_prompt`` is false (vLLM's ``/tokenize`` can ask).

        ``chat_template``: an adapter's (:meth:`chat_template`); None: the base model's.
        ``tools``: the tools offered (:func:`services.gateway.tool_calls.template_input`).
        """
        if not messages:
            raise InvalidArgument("messages is empty")
        chat = [m if isinstance(m, ChatMessage) else ChatMessage(*m) for m in messages]
        for i, message in enumerate(chat):
            if message.role not in ROLES:
                raise InvalidArgument(
                    f"messages[{i}].role must be one of {', '.join(ROLES)}, got {message.role!r}"
                )
        template = self.tokenizer.chat_template if chat_template is None else chat_template
        rendered = template_input(chat, tools, template)
        try:
            text = self.tokenizer.apply_chat_template(
                rendered.messages,
                add_generation_prompt=add_generation_prompt,
                tools=rendered.tools,
                chat_template=template,
            )
        except ChatTemplateError as error:
            raise InvalidArgument(f"messages: the chat template refused them: {error}") from None
        return self.encode(text, add_special_tokens)

    async def chat_template(self, tenant: str, adapter: str, with_tools: bool = False) -> str | None:
        """The chat template of the adapter ``adapter`` names for ``tenant``: its own, uploaded
        with it (its ``tool_use`` one ``with_tools``, when it has one); None: the base model's."""
        if not adapter:
            return None
        info = await self.access.resolve(tenant, adapter)
        return (with_tools and info.tool_use_chat_template) or info.chat_template or None

    def chat_sampling(self, requested: types_pb2.SamplingParams) -> types_pb2.SamplingParams:
        """``requested`` plus the template's end-of-turn tokens, which end a chat reply."""
        sampling = types_pb2.SamplingParams()
        sampling.CopyFrom(requested)
        if not sampling.ignore_eos:
            sampling.stop_token_ids.extend(
                t for t in self.tokenizer.eos_token_ids if t not in sampling.stop_token_ids
            )
        return sampling

    # -- generation ---------------------------------------------------------------------------

    def _sampling(self, requested: types_pb2.SamplingParams) -> types_pb2.SamplingParams:
        """``requested`` with the gateway's default ``max_tokens``, within the gateway's limit."""
        sampling = types_pb2.SamplingParams()
        sampling.CopyFrom(requested)
        sampling.max_tokens = requested.max_tokens or self.config.default_max_tokens
        if sampling.max_tokens > self.config.max_tokens_limit:
            raise InvalidArgument(
                f"sampling.max_tokens {sampling.max_tokens} is above the limit {self.config.max_tokens_limit}"
            )
        return sampling

    async def resolve_adapter(self, tenant: str, adapter: str) -> str:
        """The store id of the adapter ``adapter`` names for ``tenant`` ("" for the base model)."""
        return (await self.access.resolve(tenant, adapter)).id if adapter else ""

    async def generate(
        self,
        tenant: str,
        prompt_ids: list[int],
        adapter: str,
        sampling: types_pb2.SamplingParams,
        first_token_deadline_ms: float = 0.0,
        delivered: Delivered = NOTHING_DELIVERED,
    ) -> AsyncIterator[gateway_pb2.GenerateTextResponse]:
        """Text deltas of one generation; the last one carries the finish reason and usage.

        With ``delivered`` (what an earlier stream of this request gave its client before it
        broke), the deltas are the rest of the generation, right after it; the usage counts
        the whole generation.

        Every refusal (limits, sampling ranges, the continuation, adapter access, the tenant's
        quota, placement) is raised before the first delta, so a front end that reads one delta
        before answering answers with the right status.

        The tenant's quota admits the generation after every check of the request, charging it
        prompt + ``max_tokens``; when it ends (or fails, or its reader goes away) it is settled
        at prompt + the tokens generated here, or nothing if no delta came.

        ``first_token_deadline_ms`` (0: the gateway's default) bounds the time to the first token:
        the scheduler refuses a placement that cannot meet it, and the worker's ``early_abort``
        policy holds the request to what is left of it when it arrives there.
        """
        check_first_token_deadline(first_token_deadline_ms)
        if len(prompt_ids) > self.config.max_prompt_tokens:
            raise InvalidArgument(
                f"prompt has {len(prompt_ids)} tokens; the limit is {self.config.max_prompt_tokens}"
            )
        sampling = self._sampling(sampling)
        check_request(
            prompt_ids, sampling_from_proto(sampling), self.tokenizer.vocab_size, self.context_length
        )
        start = resume_point(delivered, len(prompt_ids), sampling, self.model_tokens)
        request = RelayRequest(
            request_id=uuid.uuid4().hex[:16],
            prompt_ids=list(prompt_ids),
            adapter_id=await self.resolve_adapter(tenant, adapter),
            sampling=sampling,
            first_token_deadline_ms=first_token_deadline_ms or self.config.default_first_token_deadline_ms,
            start=start,
            prompt_text=self.tokenizer.decode(list(prompt_ids)),
        )
        admission = await self.quota.acquire(tenant, len(prompt_ids) + sampling.max_tokens)
        replied, generated = False, 0
        try:
            # Closed explicitly, so a front end that stops reading cancels the worker's request now.
            async with contextlib.aclosing(self.relay.stream(request)) as replies:
                async for reply in replies:
                    replied, generated = True, generated + len(reply.token_ids)
                    yield reply
        finally:
            admission.settle(len(prompt_ids) + generated if replied else 0)

    # -- adapters and models ------------------------------------------------------------------

    async def upload_adapter(
        self, tenant: str, messages: AsyncIterator[UploadMessage]
    ) -> adapter_store_pb2.RegisterAdapterResponse:
        """Register an adapter streamed by the caller; the caller's tenant owns it. Chunks go on
        to the store as the bytes they arrived as (:mod:`mesh_api.upload_wire`)."""
        failed: list[Exception] = []

        async def as_tenant():
            first = True
            try:
                async for message in messages:
                    if first and message.header is not None:
                        message.header.owner = tenant
                        yield header_wire(message.header)
                    else:
                        yield message.wire
                    first = False
            except Exception as error:  # a message that does not parse (INVALID_ARGUMENT)...
                failed.append(error)
                raise

        try:
            reply = await self.store.RegisterAdapter(as_tenant())
        except asyncio.CancelledError:
            # grpc's asyncio client cancels the store's call when its request stream raises, and
            # awaiting it raises CancelledError: this RPC would end with no status (the caller
            # waited out its deadline). The caller gets what the stream raised instead.
            current = asyncio.current_task()
            if failed and (current is None or not current.cancelling()):
                raise failed[0] from None
            raise
        self.access.forget(tenant, reply.adapter.name)
        await self.adapter_index.wait_for(reply.adapter.id, present=True)
        return reply

    async def import_adapter(
        self, tenant: str, request: adapter_store_pb2.ImportAdapterRequest
    ) -> adapter_store_pb2.ImportAdapterResponse:
        """Have the store import ``request.uri`` for the caller's tenant, which owns it (the store
        checks the tenant's import policy)."""
        forwarded = adapter_store_pb2.ImportAdapterRequest()
        forwarded.CopyFrom(request)
        forwarded.owner = tenant
        reply = await self.store.ImportAdapter(forwarded)
        self.access.forget(tenant, reply.adapter.name)
        await self.adapter_index.wait_for(reply.adapter.id, present=True)
        return reply

    async def load_adapter(self, tenant: str, name: str, lora_path: str) -> types_pb2.AdapterInfo:
        """vLLM's ``load_lora_adapter``: an ``s3://``, ``hf://`` or ``file://`` URI is imported by
        the store; anything else is a path on the gateway's machine (:meth:`register_adapter_dir`)."""
        if is_import_uri(lora_path):
            request = adapter_store_pb2.ImportAdapterRequest(uri=lora_path, name=name)
            return (await self.import_adapter(tenant, request)).adapter
        return await self.register_adapter_dir(tenant, name, lora_path)

    async def register_adapter_dir(self, tenant: str, name: str, path: str) -> types_pb2.AdapterInfo:
        """Register the PEFT directory ``path`` on the gateway's machine as ``tenant``'s ``name``:
        under ``--adapter-load-dirs`` only, a relative ``path`` looked up under each of them
        (:mod:`services.gateway.adapter_load_dirs`)."""
        directory = resolve_adapter_dir(path, load_roots(self.config.adapter_load_dirs))
        files = await asyncio.to_thread(read_adapter_dir, directory)

        async def messages():
            for message in upload_wire(files, name, owner=tenant):
                yield message

        reply = await self.store.RegisterAdapter(messages())
        self.access.forget(tenant, name)
        await self.adapter_index.wait_for(reply.adapter.id, present=True)
        return reply.adapter

    async def list_adapters(
        self, tenant: str, request: adapter_store_pb2.ListAdaptersRequest
    ) -> adapter_store_pb2.ListAdaptersResponse:
        if request.owner and request.owner != tenant:
            raise PermissionDenied("a tenant may list only its own adapters (and public ones)")
        forwarded = adapter_store_pb2.ListAdaptersRequest()
        forwarded.CopyFrom(request)
        forwarded.owner, forwarded.include_public = tenant, True
        return await self.store.ListAdapters(forwarded)

    async def get_adapter(self, tenant: str, adapter: str) -> types_pb2.AdapterInfo:
        return await self.access.resolve(tenant, adapter)

    async def delete_adapter(self, tenant: str, adapter: str) -> adapter_store_pb2.DeleteAdapterResponse:
        """Delete one of the caller's own adapters."""
        owner, name = split_reference(tenant, adapter)
        if owner != tenant:
            raise PermissionDenied(f"adapter {adapter!r} belongs to tenant {owner!r}")
        reply = await self.store.DeleteAdapter(
            adapter_store_pb2.DeleteAdapterRequest(ref=ref_by_name(owner, name))
        )
        self.access.forget(owner, name)
        await self.adapter_index.wait_for(reply.adapter.id, present=False)
        return reply

    async def set_adapter_pinned(
        self, tenant: str, adapter: str, pinned: bool
    ) -> adapter_store_pb2.SetAdapterPinnedResponse:
        """Pin (or unpin) one of the caller's own adapters: the store and the workers never evict it."""
        owner, name = split_reference(tenant, adapter)
        if owner != tenant:
            raise PermissionDenied(f"adapter {adapter!r} belongs to tenant {owner!r}")
        reply = await self.store.SetAdapterPinned(
            adapter_store_pb2.SetAdapterPinnedRequest(ref=ref_by_name(owner, name), pinned=pinned)
        )
        self.access.forget(owner, name)
        return reply

    async def usable_adapters(self, tenant: str) -> list[IndexedAdapter]:
        """Every adapter ``tenant`` may use: its own and every public one, in registration order,
        from the gateway's index of the catalog (not asked of the store per call)."""
        return await self.adapter_index.usable(tenant)


def model_id(tenant: str, info: types_pb2.AdapterInfo | IndexedAdapter) -> str:
    """What ``tenant`` passes to name ``info``: ``name`` if it is its own, else ``owner/name``."""
    return info.name if info.owner == tenant else f"{info.owner}/{info.name}"
