"""The asyncio client of the loramesh gateway: :class:`AsyncClient` and its :class:`AsyncAdapters`.

The source of both clients: ``make sdk-sync`` generates ``loramesh/client.py`` from this file.

What the clients share besides their calls lives beside them: where to connect
(:mod:`loramesh.targets`), how calls are retried (:mod:`loramesh.retry`), the messages
(:mod:`loramesh.convert`), uploads (:mod:`loramesh.adapter_upload`) and the keywords of the
generating calls (:mod:`loramesh.sampling_keywords`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Self

from grpc import aio

from loramesh.adapter_upload import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    check_adapter_dir,
    upload_stream,
)
from loramesh.convert import (
    ChatMessages,
    adapter_from,
    chat_request,
    completion,
    generate_request,
    import_request,
    imported_from,
    model_from,
    page_from,
    pin_request,
    published_from,
    text_delta,
)
from loramesh.errors import Unavailable
from loramesh.retry import Call, CallPolicy, GatewayRotation, RetryNotice
from loramesh.sampling_keywords import CallKeywords, call_keywords
from loramesh.stream_resume import StreamProgress
from loramesh.targets import (
    DEFAULT_STATE_DIR,
    MESH_FILE_NAME,
    STATE_DIR_ENV,
    default_state_dir,
    resolve_targets,
)
from loramesh.tls import ClientTLS, aio_channel
from loramesh.types import (
    Adapter,
    AdapterPage,
    Completion,
    ImportedAdapter,
    Model,
    PublishedVersion,
    TextDelta,
)
from mesh_api.upload_wire import WireUploadGatewayStub
from mesh_api.v1 import adapter_store_pb2, gateway_pb2

# The clients, and the names the CLI and earlier callers import from loramesh.client (defined beside it).
__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "DEFAULT_STATE_DIR",
    "LIST_PAGE_SIZE",
    "MESH_FILE_NAME",
    "STATE_DIR_ENV",
    "AsyncAdapters",
    "AsyncClient",
    "RetryNotice",
    "check_adapter_dir",
    "default_state_dir",
    "generate_request",
    "resolve_targets",
]

LIST_PAGE_SIZE = 100
"""Adapters per request of ``adapters.list`` and ``adapters.list_page`` unless told."""


class AsyncAdapters:
    """The caller's tenant's adapters, as ``client.adapters`` (made by :class:`AsyncClient`).

    Example:
        >>> adapter = await client.adapters.upload("./my-lora", "support-bot", public=False)
        >>> [a.name for a in await client.adapters.list()]
        ['support-bot']
        >>> await client.adapters.delete("support-bot")
    """

    def __init__(self, client: AsyncClient):
        """Binds to ``client``'s connection (made by :class:`AsyncClient`, not by hand)."""
        self._client = client

    async def upload(
        self, path: str | Path, name: str, *, public: bool = False, timeout: float | None = None
    ) -> Adapter:
        """Registers a PEFT LoRA adapter directory under the caller's tenant.

        Never retried (an upload is not idempotent). Nothing is stored unless the whole adapter
        validates against the base model.

        Args:
            path: Directory with ``adapter_config.json`` and ``adapter_model.safetensors``;
                with ``tokenizer_config.json`` or ``chat_template.jinja`` too, the adapter is
                served with their chat template instead of the base model's.
            name: Name, unique within the tenant.
            public: Let every tenant use it (as ``"owner/name"``).
            timeout: Seconds for the whole upload; None for the client's default.

        Returns:
            The registered adapter.

        Raises:
            FileNotFoundError: ``path`` does not exist, or lacks ``adapter_config.json`` or the
                weights (checked before anything is sent).
            NotADirectoryError: ``path`` is a file.
            AlreadyExists: The tenant already has an adapter of that name.
            InvalidArgument: The adapter does not fit the base model, or its chat template does
                not compile (the message says why).
            ResourceExhausted: The adapter is over the size limit.
        """
        requests = upload_stream(path, name, public)
        reply = await self._client._unary("UploadAdapter", requests, timeout, retry=False)
        return adapter_from(reply.adapter)

    async def publish(
        self, path: str | Path, name: str, *, public: bool = False, timeout: float | None = None
    ) -> PublishedVersion:
        """Publishes a PEFT LoRA adapter directory as the next version of ``name`` (an upload that
        a name already registered does not refuse): what a training loop calls after each
        checkpoint. Requests naming ``name`` admitted after it returns are served by the new
        version; those admitted before keep theirs to the end; ``name@N`` and
        ``name@sha256:<hex>`` name one version (docs/api.md, "Adapter versions").

        Never retried (an upload is not idempotent).

        Args:
            path: Directory with ``adapter_config.json`` and ``adapter_model.safetensors`` (and
                optionally ``tokenizer_config.json`` / ``chat_template.jinja``).
            name: Name, unique within the tenant: its first publish registers it.
            public: Let every tenant use it (as ``"owner/name"``).
            timeout: Seconds for the whole upload; None for the client's default.

        Returns:
            The version the name serves now: its number, id and sha256, and whether this publish
            changed it (the same content again keeps the version it was).

        Raises:
            FileNotFoundError: ``path`` does not exist, or lacks ``adapter_config.json`` or the
                weights (checked before anything is sent).
            NotADirectoryError: ``path`` is a file.
            InvalidArgument: The adapter does not fit the base model, or its chat template does
                not compile (the message says why).
            ResourceExhausted: The adapter is over the size limit or the tenant's storage quota.
        """
        requests = upload_stream(path, name, public, new_version=True)
        return published_from(await self._client._unary("UploadAdapter", requests, timeout, retry=False))

    async def import_uri(
        self, uri: str, name: str, *, public: bool = False, timeout: float | None = None
    ) -> ImportedAdapter:
        """Has the adapter store import a PEFT adapter from a URI, under the caller's tenant.

        Retried like a read: importing the same content again changes nothing.

        Args:
            uri: ``s3://bucket/prefix``, ``hf://org/repo[@revision][/subdir]`` or
                ``file:///abs/path`` (on the store's machine): a directory holding
                ``adapter_config.json`` and ``adapter_model.safetensors`` (and optionally
                ``tokenizer_config.json`` / ``chat_template.jinja``).
            name: Name, unique within the tenant. An adapter already registered under it is
                kept when the content is the same and replaced by the next version otherwise.
            public: Let every tenant use it (as ``"owner/name"``).
            timeout: Seconds for the whole import; None for the client's default.

        Returns:
            The adapter the name now serves, and whether the import changed it.

        Raises:
            PermissionDenied: The store's import policy grants the tenant no source covering
                ``uri`` (or the path leads out of the granted directories).
            NotFound: No such bucket, key, Hub repository, revision or directory.
            InvalidArgument: Not a URI the store imports, not a PEFT adapter, or the adapter
                does not fit the base model.
            ResourceExhausted: The adapter is over the store's size limit.
            FailedPrecondition: A file changed during the import; import again.
        """
        request = import_request(uri, name, public)
        return imported_from(await self._client._unary("ImportAdapter", request, timeout, retry=True))

    async def list(self, *, page_size: int = LIST_PAGE_SIZE, timeout: float | None = None) -> list[Adapter]:
        """The caller's adapters and every tenant's public ones, all pages.

        Args:
            page_size: Adapters per request (at most 1000).
            timeout: Seconds for all the pages together; None for the client's default.

        Returns:
            The adapters, in the store's order.
        """
        call = self._client._policy.start(timeout)
        adapters: list[Adapter] = []
        token = ""
        while True:
            request = adapter_store_pb2.ListAdaptersRequest(page_size=page_size, page_token=token)
            page = await self._client._unary_with("ListAdapters", request, call, retry=True)
            adapters.extend(adapter_from(a) for a in page.adapters)
            token = page.next_page_token
            if not token:
                return adapters

    async def list_page(
        self, *, page_size: int = LIST_PAGE_SIZE, page_token: str = "", timeout: float | None = None
    ) -> AdapterPage:
        """One page of :meth:`list`, for callers that hold thousands of adapters.

        Args:
            page_size: Adapters on the page (at most 1000).
            page_token: ``next_page_token`` of the page before; "" for the first page.
            timeout: Seconds; None for the client's default.

        Returns:
            The page, in registration order: a token stays valid while adapters come and go
            (one registered meanwhile shows on a later page, one deleted on none).

        Raises:
            InvalidArgument: ``page_size`` is over 1000, or ``page_token`` is not one the mesh issued.
        """
        request = adapter_store_pb2.ListAdaptersRequest(page_size=page_size, page_token=page_token)
        return page_from(await self._client._unary("ListAdapters", request, timeout, retry=True))

    async def get(self, name: str, *, timeout: float | None = None) -> Adapter:
        """One adapter.

        Args:
            name: ``"name"`` (the caller's own) or ``"owner/name"`` (another tenant's public one).
            timeout: Seconds; None for the client's default.

        Raises:
            NotFound: No such adapter, or another tenant's private one (the gateway answers
                both alike).
        """
        request = gateway_pb2.GatewayAdapterRequest(adapter=name)
        return adapter_from(await self._client._unary("GetAdapter", request, timeout, retry=True))

    async def delete(self, name: str, *, timeout: float | None = None) -> Adapter:
        """Deletes one of the caller's adapters. Never retried.

        Args:
            name: The adapter's name.
            timeout: Seconds; None for the client's default.

        Returns:
            The deleted adapter.

        Raises:
            NotFound: No such adapter.
            PermissionDenied: It belongs to another tenant.
        """
        request = gateway_pb2.GatewayAdapterRequest(adapter=name)
        reply = await self._client._unary("DeleteAdapter", request, timeout, retry=False)
        return adapter_from(reply.adapter)

    async def pin(self, name: str, *, timeout: float | None = None) -> Adapter:
        """Pins one of the caller's adapters: the adapter store's RAM tier, the workers' host
        caches and their pools never evict it; it still counts against each of their budgets.
        Retried like a read (pinning twice changes nothing).

        Args:
            name: The adapter's name.
            timeout: Seconds; None for the client's default.

        Returns:
            The adapter, ``pinned``.

        Raises:
            NotFound: No such adapter.
            PermissionDenied: It belongs to another tenant.
            ResourceExhausted: The pinned adapters would not fit in the store's RAM budget.
        """
        reply = await self._client._unary("SetAdapterPinned", pin_request(name, True), timeout, retry=True)
        return adapter_from(reply.adapter)

    async def unpin(self, name: str, *, timeout: float | None = None) -> Adapter:
        """Unpins one of the caller's adapters: the caches may evict it again. Retried like a read.

        Args:
            name: The adapter's name.
            timeout: Seconds; None for the client's default.

        Returns:
            The adapter, no longer ``pinned``.

        Raises:
            NotFound: No such adapter.
            PermissionDenied: It belongs to another tenant.
        """
        reply = await self._client._unary("SetAdapterPinned", pin_request(name, False), timeout, retry=True)
        return adapter_from(reply.adapter)


class AsyncClient:
    """An asyncio connection to one or several loramesh gateways, made inside the loop it runs on.

    Calls fail with :class:`~loramesh.errors.LoraMeshError` subclasses. ``UNAVAILABLE`` is
    retried ``retries`` times with exponential backoff and jitter, each time on the next gateway,
    for calls that are safe to repeat: reads and generations. A stream that broke mid-way (its
    gateway died) continues on the next gateway right after what it yielded, whatever its
    sampling: the gateway is sent the tokens and text delivered and generates the rest
    (:mod:`loramesh.stream_resume`). ``RESOURCE_EXHAUSTED`` with a retry delay (a tenant over its
    quota, a mesh at capacity) is retried on the same gateway once the delay has passed, within
    the same ``retries``. Uploads and deletes are never retried.

    Example:
        >>> from loramesh import AsyncClient
        >>> async with AsyncClient(["10.0.0.1:50050", "10.0.0.2:50050"], api_key="sk-...") as client:
        ...     completion = await client.generate("Hello,", max_tokens=16)
        ...     print(completion.text)
        ...     async for delta in client.chat_stream([("user", "Hi!")], adapter="support-bot"):
        ...         print(delta.text, end="")

    Attributes:
        address: The first gateway's ``host:port``.
        addresses: Every gateway, in the order they are tried.
        adapters: The tenant's adapters (:class:`AsyncAdapters`).
    """

    def __init__(
        self,
        address: str | Sequence[str] | None = None,
        api_key: str | None = None,
        *,
        timeout: float | None = 60.0,
        retries: int = 6,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        mesh_file: str | Path | None = None,
        tls: ClientTLS | None = None,
        on_retry: Callable[[RetryNotice], None] | None = None,
        max_retry_after_s: float = 60.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        """Opens a channel per gateway (connecting lazily, on the first call).

        Args:
            address: ``host:port`` of the gateway, or several (a list, or one string with
                commas) to fail over between; None for the gateways of the local mesh in
                ``mesh_file``.
            api_key: The tenant's API key; None for the local mesh's admin key (only when
                talking to that mesh's gateways).
            timeout: Default seconds per call (a stream's whole duration included, across its
                retries); None for no deadline.
            retries: Times a call is retried after ``UNAVAILABLE``, or after
                ``RESOURCE_EXHAUSTED`` with a retry delay (0: never).
            backoff_s: Wait before the first retry; doubles on each next one (with jitter).
            max_backoff_s: The wait between retries never grows beyond this.
            mesh_file: The local mesh's file written by ``loramesh up``; None for ``mesh.json``
                in ``$LORAMESH_STATE_DIR``, else in ``.loramesh``.
            tls: TLS for a mesh that runs with it: ``ClientTLS("ca.pem")``, the mesh CA that
                signed the gateways' certificates (the API key names the tenant; no client
                certificate is needed); None for the mesh file's CA (``loramesh up --tls``), else
                plaintext.
            on_retry: Called before each retry, with a :class:`~loramesh.retry.RetryNotice`
                (where, which retry, how long until it).
            max_retry_after_s: ``RESOURCE_EXHAUSTED`` is retried only when the server's retry
                delay (``retry-after-s``) is at most this; 0 never retries it.
            sleep: How the client waits between attempts (tests pass a fake).

        Raises:
            NoGatewayAddress: No address was given and the mesh file has none (a ``ValueError``).
            NoApiKey: No API key was given and the mesh file's does not apply (a ``ValueError``).
        """
        self.addresses, api_key, tls = resolve_targets(address, api_key, mesh_file, tls)
        self.address = self.addresses[0]
        self._policy = CallPolicy(
            api_key, timeout, retries, backoff_s, max_backoff_s, on_retry, max_retry_after_s
        )
        self._sleep = sleep
        self._gateways = GatewayRotation(self.addresses)
        self._channels = [aio_channel(a, tls) for a in self.addresses]
        self._stubs = {a: WireUploadGatewayStub(c) for a, c in zip(self.addresses, self._channels)}
        self.adapters = AsyncAdapters(self)

    async def __aenter__(self) -> Self:
        """Returns the client itself (``async with AsyncClient(...) as client``)."""
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Closes the client."""
        await self.close()

    @property
    def failovers(self) -> int:
        """Attempts of this client's calls that failed with ``UNAVAILABLE`` and were retried on
        the next gateway (a stream continued counts once per break)."""
        return self._gateways.failovers

    async def close(self) -> None:
        """Closes the channels; calls in flight are cancelled."""
        for channel in self._channels:
            await channel.close()

    @call_keywords
    async def generate(
        self,
        prompt: str,
        *,
        call: CallKeywords,
    ) -> Completion:
        """Completes a raw prompt (no chat template) and waits for the whole text.

        Args:
            prompt: The text to continue.
            adapter: ``"name"`` (the caller's adapter), ``"owner/name"`` (another tenant's
                public one), or None for the base model.
            **sampling: The fields of :class:`~loramesh.types.Sampling`, which documents them,
                one keyword each (``max_tokens=16, temperature=0.7, seed=7``); each left
                None takes the server's default (greedy, 128 tokens).
            deadline_ms: Time-to-first-token objective the gateway schedules for; None for its
                default.
            cache_salt: Share the prompt's cached KV only with requests passing the same salt,
                whichever tenant sends them (a shared secret: make it long and random); None
                shares it only within the caller's tenant.
            timeout: Seconds for the whole call; None for the client's default.

        Returns:
            The completion.

        Raises:
            LoraMeshError: A subclass per failure (see :mod:`loramesh.errors`).
        """
        request = generate_request(prompt, call.adapter, call.sampling, call.deadline_ms, call.cache_salt)
        return completion([d async for d in self._stream("Generate", request, call.timeout)])

    @call_keywords
    def stream(
        self,
        prompt: str,
        *,
        call: CallKeywords,
    ) -> AsyncIterator[TextDelta]:
        """Completes a raw prompt, yielding text as it is generated (``async for``, no ``await``).

        The request is sent when iteration starts. A stream that breaks after yielding text
        continues on the next gateway right after what it yielded (never repeating or skipping
        text); when the retries run out it raises :class:`~loramesh.errors.StreamInterrupted`.
        To cancel the call at once when leaving the loop early, iterate under ``contextlib.aclosing``.

        Args:
            prompt: The text to continue.
            adapter: As for :meth:`generate`.
            **sampling: As for :meth:`generate`.
            deadline_ms: As for :meth:`generate`.
            cache_salt: As for :meth:`generate`.
            timeout: Seconds for the whole stream; None for the client's default.

        Yields:
            Text deltas; the last one carries ``finish_reason`` and ``usage``.
        """
        request = generate_request(prompt, call.adapter, call.sampling, call.deadline_ms, call.cache_salt)
        return self._stream("Generate", request, call.timeout)

    @call_keywords
    async def chat(
        self,
        messages: ChatMessages,
        *,
        call: CallKeywords,
    ) -> Completion:
        """Answers a conversation through the model's chat template and waits for the reply.

        Args:
            messages: ``{"role": ..., "content": ...}`` dicts or ``(role, content)`` tuples;
                roles are ``system``, ``user`` and ``assistant``.
            adapter: As for :meth:`generate`.
            **sampling: As for :meth:`generate` (the model's end-of-turn tokens always stop, as
                well as ``stop_token_ids``).
            deadline_ms: As for :meth:`generate`.
            cache_salt: As for :meth:`generate`.
            timeout: Seconds for the whole call; None for the client's default.

        Returns:
            The assistant's reply.
        """
        request = chat_request(messages, call.adapter, call.sampling, call.deadline_ms, call.cache_salt)
        return completion([d async for d in self._stream("Chat", request, call.timeout)])

    @call_keywords
    def chat_stream(
        self,
        messages: ChatMessages,
        *,
        call: CallKeywords,
    ) -> AsyncIterator[TextDelta]:
        """Answers a conversation, yielding the reply as it is generated (see :meth:`stream`).

        Args:
            messages: As for :meth:`chat`.
            adapter: As for :meth:`generate`.
            **sampling: As for :meth:`chat`.
            deadline_ms: As for :meth:`generate`.
            cache_salt: As for :meth:`generate`.
            timeout: Seconds for the whole stream; None for the client's default.

        Yields:
            Text deltas; the last one carries ``finish_reason`` and ``usage``.
        """
        request = chat_request(messages, call.adapter, call.sampling, call.deadline_ms, call.cache_salt)
        return self._stream("Chat", request, call.timeout)

    async def models(self, *, timeout: float | None = None) -> list[Model]:
        """The base model and every adapter the caller may generate with.

        Args:
            timeout: Seconds; None for the client's default.

        Returns:
            The base model first, then the adapters.
        """
        reply = await self._unary("ListModels", gateway_pb2.ListModelsRequest(), timeout, retry=True)
        return [model_from(m) for m in reply.models]

    async def _unary(self, method: str, request: Any, timeout: float | None, *, retry: bool) -> Any:
        return await self._unary_with(method, request, self._policy.start(timeout), retry=retry)

    async def _unary_with(self, method: str, request: Any, call: Call, *, retry: bool) -> Any:
        """Calls a unary-response RPC on the current gateway; when ``retry``, an UNAVAILABLE
        one is retried on the next gateway (a RESOURCE_EXHAUSTED one on the same, after its
        delay)."""
        attempt = 0
        while True:
            address = self._gateways.current()
            try:
                return await getattr(self._stubs[address], method)(
                    request, timeout=call.remaining(), metadata=call.metadata
                )
            except aio.AioRpcError as error:
                failure = call.failure(error)
                delay = call.retry_delay(attempt, failure) if retry else None
                if delay is None:
                    raise failure from error
                if isinstance(failure, Unavailable):
                    self._gateways.failed(address)
                call.announce_retry(address, self._gateways.current(), attempt, delay, failure)
            await self._sleep(delay)
            attempt += 1

    async def _stream(self, method: str, request: Any, timeout: float | None) -> AsyncIterator[TextDelta]:
        """Calls a server-streaming RPC. UNAVAILABLE is retried on the next gateway; once the
        stream has yielded something, the retry continues the generation right after it
        (:mod:`loramesh.stream_resume`), so nothing is yielded twice or lost."""
        call = self._policy.start(timeout)
        progress = StreamProgress()
        attempt = 0
        while True:
            address = self._gateways.current()
            responses = getattr(self._stubs[address], method)(
                progress.request(request), timeout=call.remaining(), metadata=call.metadata
            )
            try:
                async for message in responses:
                    delta = text_delta(message)
                    progress.record(delta)
                    yield delta
                return
            except aio.AioRpcError as error:
                if progress.finished:  # only the call's status was lost: the answer is whole
                    return
                failure = call.failure(error)
                delay = call.retry_delay(attempt, failure)
                if delay is None:
                    raise call.stream_failure(failure, progress) from error
                if isinstance(failure, Unavailable):
                    self._gateways.failed(address)
                call.announce_retry(address, self._gateways.current(), attempt, delay, failure)
            finally:
                responses.cancel()
            await self._sleep(delay)
            attempt += 1
