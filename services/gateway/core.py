"""The gateway's generation core, shared by its front ends (the gRPC servicer and the HTTP API).

API key → tenant, chat template, tokenization, request limits, the tenants' limits on
generations in flight and tokens per minute (:mod:`services.gateway.tenant_quota`), prompt and
sampling validation (:mod:`services.runtime.sampling.request_validation`, the checks the workers make
too), continuations of streams another gateway broke off (:mod:`services.gateway.continuation`),
placement + relay with resume (which also detokenizes and honours stop strings). The adapter a
request names comes resolved (:mod:`services.gateway.adapter_catalog`); adapter administration
is :mod:`services.gateway.adapter_admin`. A front end only translates its wire format to these
calls and their results back; nothing here knows about a server context or an HTTP request.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence

from mesh_api.v1 import gateway_pb2, types_pb2
from services.gateway.adapter_reference import ResolvedAdapter
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig
from services.gateway.continuation import NOTHING_DELIVERED, Delivered, ModelTokens, resume_point
from services.gateway.relay import Relay, RelayRequest
from services.gateway.tenant_quota import TenantQuota
from services.gateway.tool_calls import ChatMessage, ToolRequest, template_input
from services.model_files.tokenizer import ChatTemplateError
from services.model_files.tokenizer_loading import TokenizerBundle
from services.runtime.errors import InvalidArgument, Unavailable
from services.runtime.sampling.request_validation import check_first_token_deadline, check_request
from services.runtime.sampling.sampling_proto import sampling_from_proto

ROLES = ("system", "user", "assistant", "tool")


class GatewayCore:
    """Serves requests once :meth:`attach` has given it the tokenizer and its clients."""

    def __init__(self, config: GatewayConfig, keys: ApiKeys, quota: TenantQuota | None = None):
        """``quota``: the tenants' limits; None: those of the tenants file (``keys.quotas``)."""
        self.config = config
        self.keys = keys
        self.quota = quota or TenantQuota(keys.quotas)
        self._ready = False

    def attach(self, text: TokenizerBundle, relay: Relay) -> None:
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
        self.relay = relay
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

        ``chat_template``: an adapter's (:func:`services.gateway.adapter_reference.chat_template`);
        None: the base model's.
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

    async def generate(
        self,
        tenant: str,
        prompt_ids: list[int],
        adapter: ResolvedAdapter | None,
        sampling: types_pb2.SamplingParams,
        first_token_deadline_ms: float = 0.0,
        delivered: Delivered = NOTHING_DELIVERED,
    ) -> AsyncIterator[gateway_pb2.GenerateTextResponse]:
        """Text deltas of one generation with ``adapter`` (None: the base model's), as the
        catalog resolved it for ``tenant``; the last one carries the finish reason and usage.

        With ``delivered`` (what an earlier stream of this request gave its client before it
        broke), the deltas are the rest of the generation, right after it; the usage counts
        the whole generation.

        Every refusal (limits, sampling ranges, the continuation, the tenant's quota, placement) is raised before the first delta, so a front end that reads one delta
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
            adapter_id=adapter.id if adapter else "",
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
