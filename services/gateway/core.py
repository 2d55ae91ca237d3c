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

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence

import grpc

from mesh_api.v1 import gateway_pb2, types_pb2
from services.gateway.adapter_reference import ResolvedAdapter, chat_template, model_id
from services.gateway.adapter_version import fingerprint
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig
from services.gateway.continuation import NOTHING_DELIVERED, Delivered, ModelTokens, resume_point
from services.gateway.prefix_blocks import placement_prefix_blocks
from services.gateway.prefix_cache_namespace import prefix_cache_namespace
from services.gateway.relay import Relay, RelayRequest
from services.gateway.request_metrics import BASE_MODEL, OK, RequestMetrics
from services.gateway.template_renderer import TemplateRenderer
from services.gateway.tenant_quota import TenantQuota
from services.gateway.tool_calls import ChatMessage, ToolRequest, template_input
from services.model_files.chat_template import ChatTemplateError, TemplateOverBudget
from services.model_files.tokenizer_loading import TokenizerBundle
from services.runtime.errors import DomainError, FailedPrecondition, InvalidArgument, Unavailable
from services.runtime.sampling.request_validation import (
    InvalidField,
    check_first_token_deadline,
    check_request,
)
from services.runtime.sampling.sampling_proto import sampling_from_proto

ROLES = ("system", "user", "assistant", "tool")


class GatewayCore:
    """Serves requests once :meth:`attach` has given it the tokenizer and its clients."""

    def __init__(
        self,
        config: GatewayConfig,
        keys: ApiKeys,
        quota: TenantQuota | None = None,
        renderer: TemplateRenderer | None = None,
    ):
        """``quota``: the tenants' limits; None: those of the tenants file (``keys.quotas``).
        ``renderer``: where chat templates render; None: render processes of its own, per
        ``config`` (started when first needed, ended by :meth:`close`)."""
        self.config = config
        self.keys = keys
        self.quota = quota or TenantQuota(keys.quotas)
        keys.on_reload.append(self.quota.reconfigure)  # a tenants file edit: its new limits
        self._own_renderer = renderer is None
        self.renderer = renderer or TemplateRenderer(config.template_budget(), config.chat_template_processes)
        self.metrics = RequestMetrics(config.metric_adapter_labels)
        """Every generation's latencies, tokens and outcome (:mod:`services.gateway.request_metrics`)."""
        self._ready = False

    def attach(self, text: TokenizerBundle, relay: Relay) -> None:
        """``text``: the base model's tokenizer and limits, loaded without its weights; the
        model's name and length as ``--served-model-name`` and ``--max-model-len`` set them."""
        limit = self.config.max_model_len
        self.tokenizer, self.base_model, self.context_length = (
            text.tokenizer, self.config.served_model_name or text.model_name,
            min(limit, text.context_length) if limit else text.context_length,
        )  # fmt: skip
        self.model_tokens = ModelTokens(
            self.tokenizer.id_to_bytes,
            self.tokenizer.vocab_size,
            frozenset(self.tokenizer.eos_token_ids),
            self.context_length,
        )
        self.relay = relay
        self.metrics.model_name = text.model_name
        self._ready = True

    def close(self) -> None:
        """Ends the render processes it started."""
        if self._own_renderer:
            self.renderer.close()

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
        """``add_special_tokens``: what the tokenizer's post-processor adds (a BOS for some models).
        Tokenizes here, whatever the size: a request's prompt goes through :meth:`tokenize`."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def tokenize(self, text: str, add_special_tokens: bool = False, field: str = "prompt") -> list[int]:
        """A request's prompt as token ids: refused past ``--max-prompt-bytes`` before any of it
        is tokenized (``field`` names it), then tokenized off the event loop."""
        self._check_prompt_bytes([text], field)
        return await asyncio.to_thread(self.encode, text, add_special_tokens)

    async def tokenize_each(
        self, prompts: Sequence[str | list[int]], field: str = "prompt"
    ) -> list[list[int]]:
        """Several prompts (text, or token ids already) as token ids, each text checked as
        :meth:`tokenize` checks it before any is tokenized."""
        for prompt in prompts:
            if isinstance(prompt, str):
                self._check_prompt_bytes([prompt], field)
        return [await self.tokenize(p, field=field) if isinstance(p, str) else p for p in prompts]

    def _check_prompt_bytes(self, texts: Sequence[str], field: str, subject: str = "") -> None:
        """``texts`` together within --max-prompt-bytes, else InvalidField naming ``field``
        (``subject``: how the refusal starts, default "FIELD is"); cheap when far over: a
        character is at least one byte, so more characters than the limit are over without
        encoding any."""
        limit = self.config.max_prompt_bytes
        if sum(len(t) for t in texts) > limit:
            size = f"over {limit}"
        elif (total := sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)) > limit:
            size = str(total)
        else:
            return
        subject = subject or f"{field} is"
        raise InvalidField(field, f"{subject} {size} bytes; the limit is {limit} (--max-prompt-bytes)")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (names tokens in OpenAI's ``logprobs``)."""
        return self.tokenizer.id_to_bytes(token_id)

    async def chat_prompt(
        self,
        tenant: str,
        messages: Sequence[tuple[str, str] | ChatMessage],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        *,
        adapter: ResolvedAdapter | None = None,
        tools: ToolRequest | None = None,
    ) -> list[int]:
        """Messages (``(role, content)`` pairs, or :class:`ChatMessage` with tool calls and
        results) through the chat template, tokenized; the prompt of a reply unless
        ``add_generation_prompt`` is false (vLLM's ``/tokenize`` can ask).

        The template is ``adapter``'s own (:func:`services.gateway.adapter_reference.chat_template`;
        its ``tool_use`` one when ``tools`` are offered), else the base model's. It renders in
        the gateway's render processes, in ``tenant``'s turn and within the template budget
        (:mod:`services.gateway.template_renderer`); a template over budget is a
        ``FAILED_PRECONDITION`` naming it. The messages are refused past ``--max-prompt-bytes``
        before anything renders, and so is the rendered chat before it is tokenized.
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
        self._check_prompt_bytes(list(_message_texts(chat)), "messages")
        own = chat_template(adapter, with_tools=tools is not None)
        template = self.tokenizer.chat_template if own is None else own
        if template is None:
            raise FailedPrecondition("the base model has no chat template; send a prompt instead")
        # template_input parses the template (once per template): not on the event loop either.
        rendered = await asyncio.to_thread(template_input, chat, tools, template)
        variables = self.tokenizer.template_variables(
            rendered.messages, add_generation_prompt, tools=rendered.tools
        )
        name = _template_name(adapter, own, tools is not None)
        try:
            text = await self.renderer.render(tenant, template, variables)
        except TemplateOverBudget as over:
            setting = f" (--{over.setting.replace('_', '-')})" if over.setting else ""
            raise FailedPrecondition(
                f"{name} is over the gateway's template budget: {over.message}{setting}"
            ) from None
        except ChatTemplateError as error:
            raise InvalidArgument(f"messages: {name} refused them: {error}") from None
        # What is tokenized is the rendered chat: bounded as a prompt is, template text included.
        self._check_prompt_bytes([text], "messages", f"messages, as {name} lays them out, are")
        return await asyncio.to_thread(self.encode, text, add_special_tokens)

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
        cache_salt: str = "",
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

        ``cache_salt`` ("": none) says whose cached prompt KV it shares on the workers
        (:mod:`services.gateway.prefix_cache_namespace`): ``tenant``'s by default.
        """
        check_first_token_deadline(first_token_deadline_ms)
        namespace = prefix_cache_namespace(tenant, cache_salt)
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
            prompt_text=await asyncio.to_thread(self.tokenizer.decode, list(prompt_ids)),
            prefix_cache_namespace=namespace,
            prefix_blocks=await asyncio.to_thread(
                placement_prefix_blocks, prompt_ids, namespace, adapter, self.config.prefix_block_tokens
            ),
            prefix_block_tokens=self.config.prefix_block_tokens,
        )
        served = served_version(tenant, adapter)
        timer = self.metrics.start(tenant, f"{adapter.owner}/{adapter.name}" if adapter else BASE_MODEL)
        code = "CANCELLED"  # a reader that goes away ends it at a yield, with GeneratorExit
        try:
            admission = await self.quota.acquire(tenant, len(prompt_ids) + sampling.max_tokens)
            replied, generated = False, 0
            try:
                # Closed explicitly, so a front end that stops reading cancels the worker's request now.
                relayed = self.relay.stream(request, on_timings=lambda t: timer.queued(t.queued_ms / 1000))
                async with contextlib.aclosing(relayed) as replies:
                    async for reply in replies:
                        if served is not None and not replied:
                            reply.served_by.CopyFrom(served)
                        replied, generated = True, generated + len(reply.token_ids)
                        timer.tokens(len(reply.token_ids), len(prompt_ids))
                        if reply.finish_reason:  # the last: over, whenever its reader closes this
                            timer.end(OK)
                        yield reply
                code = OK
            finally:
                admission.settle(len(prompt_ids) + generated if replied else 0)
        except DomainError as error:
            code = error.code_name
            raise
        except grpc.RpcError as error:
            code = error.code().name if isinstance(error, grpc.aio.AioRpcError) else "UNKNOWN"
            raise
        except Exception:
            code = "UNKNOWN"
            raise
        finally:
            timer.end(code)


def served_version(tenant: str, adapter: ResolvedAdapter | None) -> gateway_pb2.ServedVersion | None:
    """How a stream's first message names the version of ``adapter`` serving it (None: the base model)."""
    if adapter is None:
        return None
    return gateway_pb2.ServedVersion(
        adapter=model_id(tenant, adapter),
        version=adapter.version,
        sha256=adapter.sha256,
        adapter_id=adapter.id,
        fingerprint=fingerprint(tenant, adapter),
    )


def _message_texts(chat: Sequence[ChatMessage]):
    """What a chat's messages hold that --max-prompt-bytes counts: contents and calls' arguments."""
    for message in chat:
        yield message.content
        for call in message.tool_calls:
            yield call.arguments


def _template_name(adapter: ResolvedAdapter | None, own: str | None, with_tools: bool) -> str:
    """How a refusal names the template that rendered: whose, and which of an adapter's."""
    if own is None or adapter is None:
        return "the base model's chat template"
    which = (
        "tool_use chat template" if with_tools and own == adapter.tool_use_chat_template else "chat template"
    )
    return f"the {which} of adapter '{adapter.owner}/{adapter.name}'"
