"""The synchronous client of the loramesh gateway, and the plumbing the asyncio one shares.

Shared with :mod:`loramesh.async_client`: where to connect, how calls are retried, and the
conversions between the SDK's dataclasses and the ``loramesh.v1`` messages.
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import grpc

from loramesh.errors import (
    REQUEST_ID_HEADER,
    LoraMeshError,
    NoApiKey,
    NoGatewayAddress,
    ResourceExhausted,
    StreamInterrupted,
    Unavailable,
    from_rpc_error,
)
from loramesh.stream_resume import StreamProgress
from loramesh.tls import ClientTLS, sync_channel
from loramesh.types import (
    Adapter,
    AdapterPage,
    Completion,
    ImportedAdapter,
    Model,
    Sampling,
    TextDelta,
    Usage,
)
from mesh_api.adapter_transfer import read_adapter_dir
from mesh_api.upload_wire import WireUploadGatewayStub, upload_wire
from mesh_api.v1 import adapter_store_pb2, gateway_pb2, types_pb2

STATE_DIR_ENV = "LORAMESH_STATE_DIR"
"""The local mesh's state directory, where ``loramesh up`` writes ``mesh.json``: the default of the
CLI's ``--state-dir`` and of the clients' ``mesh_file``."""
DEFAULT_STATE_DIR = Path(".loramesh")
"""The state directory when ``$LORAMESH_STATE_DIR`` is unset (relative to the working directory)."""
MESH_FILE_NAME = "mesh.json"
LIST_PAGE_SIZE = 100

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"
"""PEFT's older weights format, a pickle: the store refuses it."""

ChatMessages = Iterable[dict[str, str] | tuple[str, str]]
"""Chat messages: ``{"role": ..., "content": ...}`` dicts or ``(role, content)`` tuples."""

_FINISH_REASONS = {
    types_pb2.FINISH_REASON_STOP: "stop",
    types_pb2.FINISH_REASON_LENGTH: "length",
    types_pb2.FINISH_REASON_CANCELLED: "cancelled",
    types_pb2.FINISH_REASON_ERROR: "error",
}


def default_state_dir() -> Path:
    """``$LORAMESH_STATE_DIR``, else ``.loramesh``. Read at each call, never at import, so a
    variable set after ``import loramesh`` counts."""
    return Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)


def check_adapter_dir(path: str | Path) -> Path:
    """``path``, once it looks like a PEFT adapter directory: it exists, is a directory, and holds
    ``adapter_config.json`` and ``adapter_model.safetensors``. Checked before anything is sent, so
    a wrong directory is named at once; the store validates the contents.

    Raises:
        FileNotFoundError: It does not exist, or lacks a file (the message names both).
        NotADirectoryError: It is a file.
    """
    directory = Path(path)
    if not directory.exists():
        raise FileNotFoundError(f"adapter directory {directory} does not exist")
    if not directory.is_dir():
        raise NotADirectoryError(f"{directory} is a file, not an adapter directory")
    if not (directory / ADAPTER_CONFIG_FILE).is_file():
        raise FileNotFoundError(f"adapter directory {directory} has no {ADAPTER_CONFIG_FILE}")
    if not (directory / ADAPTER_WEIGHTS_FILE).is_file():
        pickled = (directory / PICKLED_WEIGHTS_FILE).is_file()
        instead = f" ({PICKLED_WEIGHTS_FILE} is a pickle, which is not accepted: save it as safetensors)"
        raise FileNotFoundError(
            f"adapter directory {directory} has no {ADAPTER_WEIGHTS_FILE}{instead if pickled else ''}"
        )
    return directory


def resolve_targets(
    address: str | Sequence[str] | None,
    api_key: str | None,
    mesh_file: str | Path | None,
    tls: ClientTLS | None = None,
) -> tuple[tuple[str, ...], str, ClientTLS | None]:
    """The gateway addresses, API key and TLS files, the missing ones taken from a local mesh's
    file.

    The mesh file's ``admin_api_key`` and ``tls`` are only used when every address is one of the
    mesh file's gateways, so a key never goes to a server it was not issued by.

    Args:
        address: ``host:port`` of a gateway, several of them (a sequence, or one string with
            commas), or None for the mesh file's gateways.
        api_key: The caller's API key, or None for the mesh file's admin key.
        mesh_file: The file ``loramesh up`` writes (``{"gateway_addresses", "services":
            {"gateway": {"address"}}, "admin_api_key", "tls"}``); ignored when it does not exist.
            None: ``mesh.json`` in :func:`default_state_dir`.
        tls: The client's mutual TLS files, or None for the mesh file's (if it has any).

    Returns:
        ``(addresses, api_key, tls)``; ``tls`` None: plaintext.

    Raises:
        NoGatewayAddress: No address is given and the mesh file has none (a ``ValueError``).
        NoApiKey: No key is given and the mesh file's does not apply (a ``ValueError``).
    """
    path = Path(mesh_file) if mesh_file is not None else default_state_dir() / MESH_FILE_NAME
    mesh = json.loads(path.read_text()) if path.is_file() else {}
    first = mesh.get("services", {}).get("gateway", {}).get("address")
    mesh_addresses = tuple(mesh.get("gateway_addresses") or ([first] if first else []))
    if isinstance(address, str):
        address = address.split(",")
    addresses = tuple(a.strip() for a in address or () if a.strip()) or mesh_addresses
    if not addresses:
        found = "names no gateway" if path.is_file() else "does not exist"
        raise NoGatewayAddress(
            f"no gateway address: pass address=, or start a mesh with `loramesh up` ({path.absolute()} "
            f"{found}; ${STATE_DIR_ENV} names the state directory of a mesh started elsewhere)",
            path,
        )
    own_mesh = set(addresses) <= set(mesh_addresses)
    if api_key is None and own_mesh:
        api_key = mesh.get("admin_api_key")
    if not api_key:
        whose = (
            f"the admin key of {path.absolute()} goes only to that mesh's own gateways"
            if path.is_file()
            else f"no {path.absolute()} to take a local mesh's admin key from"
        )
        raise NoApiKey(
            f"no API key for the gateway at {', '.join(addresses)}: pass api_key= ({whose})", addresses
        )
    if tls is None and own_mesh and mesh.get("tls"):
        tls = ClientTLS.from_mapping(mesh["tls"])
    return addresses, api_key, tls


class GatewayRotation:
    """Which of several gateways a client calls now. Every call starts on the current one; a
    retryable failure there moves the client on to the next (round robin), for every later
    call too, so a dead gateway is left after one failure."""

    def __init__(self, addresses: Sequence[str]):
        self.addresses = tuple(addresses)
        self._index = 0
        self.failovers = 0
        """Attempts that failed with a retryable status and were retried, over the client's life."""

    def current(self) -> str:
        return self.addresses[self._index]

    def failed(self, address: str) -> None:
        """A call to ``address`` failed with a retryable status: move past it (unless another
        call already did)."""
        self.failovers += 1
        if self.addresses[self._index] == address:
            self._index = (self._index + 1) % len(self.addresses)


@dataclass(frozen=True)
class RetryNotice:
    """An attempt failed with ``UNAVAILABLE`` (or ``RESOURCE_EXHAUSTED`` with a retry delay) and is
    about to be retried: what a client's ``on_retry`` is called with (the CLI prints it, so a
    dead gateway is not silent)."""

    failed_address: str
    """The gateway the failed attempt went to."""
    next_address: str
    """The gateway the retry goes to (the next one after ``UNAVAILABLE``, when there are several;
    the same one after ``RESOURCE_EXHAUSTED``)."""
    retry: int
    """This retry's number, from 1."""
    retries: int
    """The most retries the call makes (the client's ``retries``)."""
    delay_s: float
    """Seconds until the retry is sent."""
    failure: LoraMeshError
    """What the failed attempt raised."""


@dataclass(frozen=True)
class _Policy:
    """How every call of a client is made: credentials, default timeout, retries."""

    api_key: str
    timeout: float | None
    retries: int
    backoff_s: float
    max_backoff_s: float
    on_retry: Callable[[RetryNotice], None] | None = None
    max_retry_after_s: float = 60.0
    """A ``RESOURCE_EXHAUSTED`` whose retry delay is longer than this is not retried."""

    def start(self, timeout: float | None) -> _Call:
        """The bookkeeping of one logical call (all its attempts) with a per-call ``timeout``."""
        budget = self.timeout if timeout is None else timeout
        request_id = uuid.uuid4().hex[:16]
        return _Call(
            metadata=(("authorization", f"Bearer {self.api_key}"), (REQUEST_ID_HEADER, request_id)),
            request_id=request_id,
            deadline=None if budget is None else time.monotonic() + budget,
            policy=self,
        )


@dataclass(frozen=True)
class _Call:
    """One logical call: its metadata, its deadline across attempts, and when to retry."""

    metadata: tuple[tuple[str, str], ...]
    request_id: str
    deadline: float | None
    policy: _Policy

    def remaining(self) -> float | None:
        """Seconds left before the call's deadline (the gRPC timeout of the next attempt)."""
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def failure(self, error: grpc.RpcError) -> LoraMeshError:
        """The SDK exception for an attempt's gRPC error."""
        return from_rpc_error(error, self.request_id)

    def retry_delay(self, attempt: int, failure: LoraMeshError) -> float | None:
        """Seconds to wait before the next attempt, or None when ``failure`` is final.

        Final: retries used up; not UNAVAILABLE, nor RESOURCE_EXHAUSTED with a retry delay of
        at most ``max_retry_after_s`` (a tenant's quota, a full mesh); or the wait would outlast
        the deadline. After UNAVAILABLE the backoff doubles per attempt, with jitter; after
        RESOURCE_EXHAUSTED the wait is the server's delay, never less, plus up to 10% (so that
        clients refused together do not all come back at once).

        Args:
            attempt: The failed attempt's number, from 0.
            failure: What it failed with.
        """
        if attempt >= self.policy.retries:
            return None
        if isinstance(failure, ResourceExhausted):
            if failure.retry_after_s is None or failure.retry_after_s > self.policy.max_retry_after_s:
                return None
            delay = max(failure.retry_after_s, 0.0) * random.uniform(1.0, 1.1)
        elif isinstance(failure, Unavailable):
            delay = min(self.policy.backoff_s * 2**attempt, self.policy.max_backoff_s) * random.uniform(
                0.5, 1.0
            )
        else:
            return None
        if self.deadline is not None and time.monotonic() + delay >= self.deadline:
            return None
        return delay

    def announce_retry(
        self, failed_address: str, next_address: str, attempt: int, delay: float, failure: LoraMeshError
    ) -> None:
        """Tells the client's ``on_retry`` (if any) that attempt ``attempt`` (from 0) is retried."""
        if self.policy.on_retry is not None:
            notice = RetryNotice(
                failed_address, next_address, attempt + 1, self.policy.retries, delay, failure
            )
            self.policy.on_retry(notice)

    def stream_failure(self, failure: LoraMeshError, progress: StreamProgress) -> LoraMeshError:
        """What a stream that is not retried raises: UNAVAILABLE after it yielded text becomes
        :class:`StreamInterrupted` (the caller has part of an answer)."""
        if not progress.delivered or not isinstance(failure, Unavailable):
            return failure
        return StreamInterrupted(
            f"{failure.details}; the stream broke after {len(progress.token_ids)} tokens and was not "
            f"continued (the retries ran out)",
            request_id=failure.request_id,
        )


def _sampling_params(sampling: Sampling) -> types_pb2.SamplingParams:
    params = types_pb2.SamplingParams(
        max_tokens=sampling.max_tokens or 0,
        temperature=sampling.temperature or 0.0,
        top_k=sampling.top_k or 0,
        top_p=sampling.top_p or 0.0,
        repetition_penalty=sampling.repetition_penalty or 0.0,
        stop_token_ids=sampling.stop_token_ids or (),
        stop_strings=sampling.stop or (),
        ignore_eos=bool(sampling.ignore_eos),
    )
    if sampling.seed is not None:
        params.seed = sampling.seed
    return params


def generate_request(
    prompt: str, adapter: str | None, sampling: Sampling, deadline_ms: float | None
) -> gateway_pb2.GenerateTextRequest:
    """The ``Generate`` request."""
    return gateway_pb2.GenerateTextRequest(
        prompt=prompt,
        adapter=adapter or "",
        sampling=_sampling_params(sampling),
        first_token_deadline_ms=deadline_ms or 0.0,
    )


def chat_request(
    messages: ChatMessages, adapter: str | None, sampling: Sampling, deadline_ms: float | None
) -> gateway_pb2.ChatRequest:
    """The ``Chat`` request.

    Raises:
        TypeError: A message is neither a dict nor a ``(role, content)`` pair.
    """
    return gateway_pb2.ChatRequest(
        messages=[_chat_message(m) for m in messages],
        adapter=adapter or "",
        sampling=_sampling_params(sampling),
        first_token_deadline_ms=deadline_ms or 0.0,
    )


def _chat_message(message: dict[str, str] | tuple[str, str]) -> gateway_pb2.ChatMessage:
    if isinstance(message, dict):
        return gateway_pb2.ChatMessage(role=message["role"], content=message["content"])
    if isinstance(message, tuple) and len(message) == 2:
        return gateway_pb2.ChatMessage(role=message[0], content=message[1])
    raise TypeError(
        f"a chat message is a {{'role', 'content'}} dict or a (role, content) tuple, got {message!r}"
    )


def text_delta(message: gateway_pb2.GenerateTextResponse) -> TextDelta:
    """The SDK's view of one streamed message."""
    usage = None
    if message.HasField("usage"):
        u = message.usage
        usage = Usage(
            u.prompt_tokens, u.completion_tokens, u.first_token_ms, u.total_ms, u.resumes, u.migrations
        )
    return TextDelta(
        text=message.text,
        token_ids=tuple(message.token_ids),
        finish_reason=_FINISH_REASONS.get(message.finish_reason),
        usage=usage,
        request_id=message.request_id,
    )


def completion(deltas: list[TextDelta]) -> Completion:
    """A whole stream's deltas joined into one completion."""
    return Completion(
        text="".join(d.text for d in deltas),
        token_ids=tuple(t for d in deltas for t in d.token_ids),
        finish_reason=next((d.finish_reason for d in reversed(deltas) if d.finish_reason), None),
        usage=next((d.usage for d in reversed(deltas) if d.usage), None),
        request_id=next((d.request_id for d in deltas if d.request_id), ""),
    )


def adapter_from(info: types_pb2.AdapterInfo) -> Adapter:
    """The SDK's view of an ``AdapterInfo``."""
    return Adapter(
        id=info.id,
        name=info.name,
        owner=info.owner,
        public=info.visibility == types_pb2.VISIBILITY_PUBLIC,
        base_model=info.base_model,
        rank=info.rank,
        max_rank=info.max_rank,
        lora_alpha=info.lora_alpha,
        use_rslora=info.use_rslora,
        target_modules=tuple(info.target_modules),
        dtype=info.dtype,
        size_bytes=info.size_bytes,
        sha256=info.sha256,
        version=info.version,
        created_unix_ms=info.created_unix_ms,
        config_json=info.config_json,
        pinned=info.pinned,
    )


def model_from(info: gateway_pb2.ModelInfo) -> Model:
    """The SDK's view of a ``ModelInfo``."""
    return Model(
        id=info.id,
        owner=info.owner,
        base_model=info.base_model,
        is_base=info.is_base,
        rank=info.rank,
        public=info.visibility == types_pb2.VISIBILITY_PUBLIC,
    )


def upload_stream(path: str | Path, name: str, public: bool) -> Iterator[bytes]:
    """The ``UploadAdapter`` messages for a PEFT adapter directory, serialized (the clients'
    stubs send them as they are: each chunk is copied once, see ``mesh_api.upload_wire``).

    A header, then chunks (``mesh_api.upload_wire.UPLOAD_CHUNK_BYTES`` at most) of
    ``adapter_config.json`` and ``adapter_model.safetensors``, and of ``tokenizer_config.json``
    and ``chat_template.jinja`` when the directory has them (the adapter is then served with
    their chat template).

    Raises:
        FileNotFoundError: ``path`` does not exist or lacks a file (:func:`check_adapter_dir`).
        NotADirectoryError: ``path`` is a file.
    """
    check_adapter_dir(path)
    visibility = types_pb2.VISIBILITY_PUBLIC if public else types_pb2.VISIBILITY_PRIVATE
    # The owner is left empty: the gateway sets the caller's tenant.
    return upload_wire(read_adapter_dir(path), name, owner="", visibility=visibility)


def import_request(uri: str, name: str, public: bool) -> adapter_store_pb2.ImportAdapterRequest:
    """The ``ImportAdapter`` request (the owner is left empty: the gateway sets the caller's tenant)."""
    visibility = types_pb2.VISIBILITY_PUBLIC if public else types_pb2.VISIBILITY_PRIVATE
    return adapter_store_pb2.ImportAdapterRequest(uri=uri, name=name, visibility=visibility)


def imported_from(reply: adapter_store_pb2.ImportAdapterResponse) -> ImportedAdapter:
    return ImportedAdapter(adapter_from(reply.adapter), reply.changed)


def pin_request(name: str, pinned: bool) -> gateway_pb2.GatewayPinRequest:
    """The ``SetAdapterPinned`` request for the caller's adapter ``name``."""
    return gateway_pb2.GatewayPinRequest(adapter=name, pinned=pinned)


def page_from(reply: adapter_store_pb2.ListAdaptersResponse) -> AdapterPage:
    return AdapterPage(tuple(adapter_from(a) for a in reply.adapters), reply.next_page_token, reply.total)


class Adapters:
    """The caller's tenant's adapters, as ``client.adapters``.

    Example:
        >>> adapter = client.adapters.upload("./my-lora", "support-bot", public=False)
        >>> [a.name for a in client.adapters.list()]
        ['support-bot']
        >>> client.adapters.delete("support-bot")
    """

    def __init__(self, client: Client):
        """Binds to ``client``'s connection (made by :class:`Client`, not by hand)."""
        self._client = client

    def upload(
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
        reply = self._client._unary("UploadAdapter", requests, timeout, retry=False)
        return adapter_from(reply.adapter)

    def import_uri(
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
        return imported_from(self._client._unary("ImportAdapter", request, timeout, retry=True))

    def list(self, *, page_size: int = LIST_PAGE_SIZE, timeout: float | None = None) -> list[Adapter]:
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
            page = self._client._unary_with("ListAdapters", request, call, retry=True)
            adapters.extend(adapter_from(a) for a in page.adapters)
            token = page.next_page_token
            if not token:
                return adapters

    def list_page(
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
        return page_from(self._client._unary("ListAdapters", request, timeout, retry=True))

    def get(self, name: str, *, timeout: float | None = None) -> Adapter:
        """One adapter.

        Args:
            name: ``"name"`` (the caller's own) or ``"owner/name"`` (another tenant's public one).
            timeout: Seconds; None for the client's default.

        Raises:
            NotFound: No such adapter, or another tenant's private one (the gateway answers
                both alike).
        """
        request = gateway_pb2.GatewayAdapterRequest(adapter=name)
        return adapter_from(self._client._unary("GetAdapter", request, timeout, retry=True))

    def delete(self, name: str, *, timeout: float | None = None) -> Adapter:
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
        reply = self._client._unary("DeleteAdapter", request, timeout, retry=False)
        return adapter_from(reply.adapter)

    def pin(self, name: str, *, timeout: float | None = None) -> Adapter:
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
        reply = self._client._unary("SetAdapterPinned", pin_request(name, True), timeout, retry=True)
        return adapter_from(reply.adapter)

    def unpin(self, name: str, *, timeout: float | None = None) -> Adapter:
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
        reply = self._client._unary("SetAdapterPinned", pin_request(name, False), timeout, retry=True)
        return adapter_from(reply.adapter)


class Client:
    """A synchronous connection to one or several loramesh gateways (thread-safe).

    Calls fail with :class:`~loramesh.errors.LoraMeshError` subclasses. ``UNAVAILABLE`` is
    retried ``retries`` times with exponential backoff and jitter, each time on the next gateway,
    for calls that are safe to repeat: reads and generations. A stream that broke mid-way (its
    gateway died) continues on the next gateway right after what it yielded, whatever its
    sampling: the gateway is sent the tokens and text delivered and generates the rest
    (:mod:`loramesh.stream_resume`). ``RESOURCE_EXHAUSTED`` with a retry delay (a tenant over its
    quota, a mesh at capacity) is retried on the same gateway once the delay has passed, within
    the same ``retries``. Uploads and deletes are never retried.

    Example:
        >>> from loramesh import Client
        >>> with Client(["10.0.0.1:50051", "10.0.0.2:50051"], api_key="sk-...") as client:
        ...     print(client.generate("Hello,", max_tokens=16).text)
        ...     for delta in client.chat_stream([("user", "Hi!")], adapter="support-bot"):
        ...         print(delta.text, end="")

    Attributes:
        address: The first gateway's ``host:port``.
        addresses: Every gateway, in the order they are tried.
        adapters: The tenant's adapters (:class:`Adapters`).
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
        sleep: Callable[[float], None] = time.sleep,
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
            on_retry: Called before each retry, with a :class:`RetryNotice` (where, which
                retry, how long until it).
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
        self._channels = [sync_channel(a, tls) for a in self.addresses]
        self._stubs = {a: WireUploadGatewayStub(c) for a, c in zip(self.addresses, self._channels)}
        self.adapters = Adapters(self)

    def __enter__(self) -> Self:
        """Returns the client itself (``with Client(...) as client``)."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Closes the client."""
        self.close()

    @property
    def failovers(self) -> int:
        """Attempts of this client's calls that failed with ``UNAVAILABLE`` and were retried on
        the next gateway (a stream continued counts once per break)."""
        return self._gateways.failovers

    def close(self) -> None:
        """Closes the channels; calls in flight are cancelled."""
        for channel in self._channels:
            channel.close()

    def generate(
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
        return completion(list(self._stream("Generate", request, timeout)))

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
    ) -> Iterator[TextDelta]:
        """Completes a raw prompt, yielding text as it is generated.

        The request is sent when iteration starts; leaving the loop early cancels it. A stream
        that breaks after yielding text continues on the next gateway right after what it
        yielded (never repeating or skipping text); when the retries run out it raises
        :class:`~loramesh.errors.StreamInterrupted`.

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

    def chat(
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
        return completion(list(self._stream("Chat", request, timeout)))

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
    ) -> Iterator[TextDelta]:
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

    def models(self, *, timeout: float | None = None) -> list[Model]:
        """The base model and every adapter the caller may generate with.

        Args:
            timeout: Seconds; None for the client's default.

        Returns:
            The base model first, then the adapters.
        """
        reply = self._unary("ListModels", gateway_pb2.ListModelsRequest(), timeout, retry=True)
        return [model_from(m) for m in reply.models]

    def _unary(self, method: str, request: Any, timeout: float | None, *, retry: bool) -> Any:
        return self._unary_with(method, request, self._policy.start(timeout), retry=retry)

    def _unary_with(self, method: str, request: Any, call: _Call, *, retry: bool) -> Any:
        """Calls a unary-response RPC on the current gateway; when ``retry``, an UNAVAILABLE
        one is retried on the next gateway (a RESOURCE_EXHAUSTED one on the same, after its
        delay)."""
        attempt = 0
        while True:
            address = self._gateways.current()
            try:
                return getattr(self._stubs[address], method)(
                    request, timeout=call.remaining(), metadata=call.metadata
                )
            except grpc.RpcError as error:
                failure = call.failure(error)
                delay = call.retry_delay(attempt, failure) if retry else None
                if delay is None:
                    raise failure from error
                if isinstance(failure, Unavailable):
                    self._gateways.failed(address)
                call.announce_retry(address, self._gateways.current(), attempt, delay, failure)
            self._sleep(delay)
            attempt += 1

    def _stream(self, method: str, request: Any, timeout: float | None) -> Iterator[TextDelta]:
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
                for message in responses:
                    delta = text_delta(message)
                    progress.record(delta)
                    yield delta
                return
            except grpc.RpcError as error:
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
            self._sleep(delay)
            attempt += 1
