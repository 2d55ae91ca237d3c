"""The asyncio client of the loramesh gateway: :class:`loramesh.Client`'s API with ``await``.

Request building, retry policy and conversions are :mod:`loramesh.client`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Self

from grpc import aio

from loramesh.client import (
    LIST_PAGE_SIZE,
    ChatMessages,
    GatewayRotation,
    RetryNotice,
    _Call,
    _Policy,
    adapter_from,
    chat_request,
    completion,
    generate_request,
    import_request,
    imported_from,
    model_from,
    page_from,
    pin_request,
    resolve_targets,
    text_delta,
    upload_stream,
)
from loramesh.errors import Unavailable
from loramesh.stream_resume import StreamProgress
from loramesh.tls import ClientTLS, aio_channel
from loramesh.types import Adapter, AdapterPage, Completion, ImportedAdapter, Model, Sampling, TextDelta
from mesh_api.upload_wire import WireUploadGatewayStub
from mesh_api.v1 import adapter_store_pb2, gateway_pb2


class AsyncAdapters:
    """The caller's tenant's adapters, as ``client.adapters`` of an :class:`AsyncClient`.

    Example:
        >>> adapter = await client.adapters.upload("./my-lora", "support-bot")
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
        """Registers a PEFT LoRA adapter directory under the caller's tenant. Never retried.

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
        """One page of :meth:`list`, as :meth:`loramesh.Client.adapters.list_page
        <loramesh.client.Adapters.list_page>`."""
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
        """Pins one of the caller's adapters, as :meth:`loramesh.Client.adapters.pin
        <loramesh.client.Adapters.pin>`."""
        reply = await self._client._unary("SetAdapterPinned", pin_request(name, True), timeout, retry=True)
        return adapter_from(reply.adapter)

    async def unpin(self, name: str, *, timeout: float | None = None) -> Adapter:
        """Unpins one of the caller's adapters, as :meth:`loramesh.Client.adapters.unpin
        <loramesh.client.Adapters.unpin>`."""
        reply = await self._client._unary("SetAdapterPinned", pin_request(name, False), timeout, retry=True)
        return adapter_from(reply.adapter)


class AsyncClient:
    """An asyncio connection to one or several loramesh gateways; create it inside the event loop
    it is used on.

    Same behaviour as :class:`loramesh.Client`: :class:`~loramesh.errors.LoraMeshError`
    subclasses on failure, ``UNAVAILABLE`` retried with backoff on the next gateway for reads
    and generations (a stream that broke mid-way continues there right after what it yielded,
    whatever its sampling), ``RESOURCE_EXHAUSTED`` with a retry delay retried on the same gateway
    after it; never for uploads and deletes.

    Example:
        >>> from loramesh import AsyncClient
        >>> async with AsyncClient(["10.0.0.1:50051", "10.0.0.2:50051"], api_key="sk-...") as client:
        ...     print((await client.generate("Hello,", max_tokens=16)).text)
        ...     async for delta in client.chat_stream([("user", "Hi!")]):
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
            tls: Mutual TLS files for a mesh that requires them; None for the mesh file's
                (``loramesh up --tls``), else plaintext.
            on_retry: Called before each retry, with a :class:`~loramesh.client.RetryNotice`.
            max_retry_after_s: ``RESOURCE_EXHAUSTED`` is retried only when the server's retry
                delay (``retry-after-s``) is at most this; 0 never retries it.
            sleep: How the client waits between attempts (tests pass a fake).

        Raises:
            NoGatewayAddress: No address was given and the mesh file has none (a ``ValueError``).
            NoApiKey: No API key was given and the mesh file's does not apply (a ``ValueError``).
        """
        self.addresses, api_key, tls = resolve_targets(address, api_key, mesh_file, tls)
        self.address = self.addresses[0]
        self._policy = _Policy(
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

    async def generate(
        self,
        prompt: str,
        *,
        adapter: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool | None = None,
        deadline_ms: float | None = None,
        timeout: float | None = None,
    ) -> Completion:
        """Completes a raw prompt (no chat template) and waits for the whole text.

        Args:
            prompt: The text to continue.
            adapter: ``"name"`` (the caller's adapter), ``"owner/name"`` (another tenant's
                public one), or None for the base model.
            max_tokens: Most tokens to generate; None for the server's default (128).
            temperature: None or 0 for greedy decoding.
            top_k: Sample among the k likeliest tokens; None for off.
            top_p: Nucleus sampling mass; None for off.
            repetition_penalty: None for off.
            seed: Sampler seed, for reproducible sampling: each token's random draw is keyed
                by the seed and the token's position, not by the batch it ran in, so a failover
                continues with the tokens the unbroken stream would have had.
            stop: Strings that end the generation.
            stop_token_ids: Token ids that end the generation.
            ignore_eos: Keep generating past the model's end-of-sequence token (to
                ``max_tokens``), as benchmarks do.
            deadline_ms: Time-to-first-token objective the gateway schedules for; None for its
                default.
            timeout: Seconds for the whole call; None for the client's default.

        Returns:
            The completion.

        Raises:
            LoraMeshError: A subclass per failure (see :mod:`loramesh.errors`).
        """
        sampling = Sampling(
            max_tokens, temperature, top_k, top_p, repetition_penalty, seed, stop, stop_token_ids, ignore_eos
        )
        request = generate_request(prompt, adapter, sampling, deadline_ms)
        deltas = self._stream("Generate", request, timeout)
        return completion([d async for d in deltas])

    def stream(
        self,
        prompt: str,
        *,
        adapter: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool | None = None,
        deadline_ms: float | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[TextDelta]:
        """Completes a raw prompt, yielding text as it is generated (``async for``, no ``await``).

        The request is sent when iteration starts. A stream that breaks after yielding text
        continues on the next gateway right after what it yielded (never repeating or skipping
        text); when the retries run out it raises :class:`~loramesh.errors.StreamInterrupted`.
        To cancel the call at once when leaving the loop early, iterate under
        ``contextlib.aclosing``.

        Args:
            prompt: The text to continue.
            adapter: As for :meth:`generate`.
            max_tokens: As for :meth:`generate`.
            temperature: As for :meth:`generate`.
            top_k: As for :meth:`generate`.
            top_p: As for :meth:`generate`.
            repetition_penalty: As for :meth:`generate`.
            seed: As for :meth:`generate`.
            stop: As for :meth:`generate`.
            stop_token_ids: As for :meth:`generate`.
            deadline_ms: As for :meth:`generate`.
            timeout: Seconds for the whole stream; None for the client's default.

        Yields:
            Text deltas; the last one carries ``finish_reason`` and ``usage``.
        """
        sampling = Sampling(
            max_tokens, temperature, top_k, top_p, repetition_penalty, seed, stop, stop_token_ids, ignore_eos
        )
        request = generate_request(prompt, adapter, sampling, deadline_ms)
        return self._stream("Generate", request, timeout)

    async def chat(
        self,
        messages: ChatMessages,
        *,
        adapter: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool | None = None,
        deadline_ms: float | None = None,
        timeout: float | None = None,
    ) -> Completion:
        """Answers a conversation through the model's chat template and waits for the reply.

        Args:
            messages: ``{"role": ..., "content": ...}`` dicts or ``(role, content)`` tuples;
                roles are ``system``, ``user`` and ``assistant``.
            adapter: As for :meth:`generate`.
            max_tokens: As for :meth:`generate`.
            temperature: As for :meth:`generate`.
            top_k: As for :meth:`generate`.
            top_p: As for :meth:`generate`.
            repetition_penalty: As for :meth:`generate`.
            seed: As for :meth:`generate`.
            stop: As for :meth:`generate`.
            stop_token_ids: As for :meth:`generate` (the model's end-of-turn tokens always stop).
            deadline_ms: As for :meth:`generate`.
            timeout: Seconds for the whole call; None for the client's default.

        Returns:
            The assistant's reply.
        """
        sampling = Sampling(
            max_tokens, temperature, top_k, top_p, repetition_penalty, seed, stop, stop_token_ids, ignore_eos
        )
        request = chat_request(messages, adapter, sampling, deadline_ms)
        deltas = self._stream("Chat", request, timeout)
        return completion([d async for d in deltas])

    def chat_stream(
        self,
        messages: ChatMessages,
        *,
        adapter: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool | None = None,
        deadline_ms: float | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[TextDelta]:
        """Answers a conversation, yielding the reply as it is generated (see :meth:`stream`).

        Args:
            messages: As for :meth:`chat`.
            adapter: As for :meth:`generate`.
            max_tokens: As for :meth:`generate`.
            temperature: As for :meth:`generate`.
            top_k: As for :meth:`generate`.
            top_p: As for :meth:`generate`.
            repetition_penalty: As for :meth:`generate`.
            seed: As for :meth:`generate`.
            stop: As for :meth:`generate`.
            stop_token_ids: As for :meth:`chat`.
            deadline_ms: As for :meth:`generate`.
            timeout: Seconds for the whole stream; None for the client's default.

        Yields:
            Text deltas; the last one carries ``finish_reason`` and ``usage``.
        """
        sampling = Sampling(
            max_tokens, temperature, top_k, top_p, repetition_penalty, seed, stop, stop_token_ids, ignore_eos
        )
        request = chat_request(messages, adapter, sampling, deadline_ms)
        return self._stream("Chat", request, timeout)

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

    async def _unary_with(self, method: str, request: Any, call: _Call, *, retry: bool) -> Any:
        """Calls a unary-response RPC on the current gateway; when ``retry``, an UNAVAILABLE
        one is retried on the next gateway."""
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
        """Calls a server-streaming RPC; retries and continues as :meth:`loramesh.Client._stream`."""
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
