"""The conversions between the SDK's dataclasses and the ``loramesh.v1`` messages: the requests
both clients send and what they make of the replies."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields

from loramesh.types import (
    Adapter,
    AdapterPage,
    Completion,
    ImportedAdapter,
    Model,
    PublishedVersion,
    Sampling,
    ServedVersion,
    TextDelta,
    Usage,
)
from mesh_api.v1 import adapter_store_pb2, gateway_pb2, types_pb2

ChatMessages = Iterable[dict[str, str] | tuple[str, str]]
"""Chat messages: ``{"role": ..., "content": ...}`` dicts or ``(role, content)`` tuples."""

_FINISH_REASONS = {
    types_pb2.FINISH_REASON_STOP: "stop",
    types_pb2.FINISH_REASON_LENGTH: "length",
    types_pb2.FINISH_REASON_CANCELLED: "cancelled",
    types_pb2.FINISH_REASON_ERROR: "error",
}

_SAMPLING_WIRE_NAMES = {"stop": "stop_strings"}
"""The :class:`Sampling` fields whose ``SamplingParams`` field is named otherwise; every other
field is sent under its own name."""


def sampling_params(sampling: Sampling) -> types_pb2.SamplingParams:
    """The ``SamplingParams`` of ``sampling``: a field left None is left unset, which the server
    reads as its default (and ``seed`` stays absent, so the draw is random)."""
    values = {_SAMPLING_WIRE_NAMES.get(f.name, f.name): getattr(sampling, f.name) for f in fields(sampling)}
    return types_pb2.SamplingParams(**{name: value for name, value in values.items() if value is not None})


def generate_request(
    prompt: str,
    adapter: str | None,
    sampling: Sampling,
    deadline_ms: float | None,
    cache_salt: str | None = None,
) -> gateway_pb2.GenerateTextRequest:
    """The ``Generate`` request."""
    return gateway_pb2.GenerateTextRequest(
        prompt=prompt,
        adapter=adapter or "",
        sampling=sampling_params(sampling),
        first_token_deadline_ms=deadline_ms or 0.0,
        cache_salt=cache_salt or "",
    )


def chat_request(
    messages: ChatMessages,
    adapter: str | None,
    sampling: Sampling,
    deadline_ms: float | None,
    cache_salt: str | None = None,
) -> gateway_pb2.ChatRequest:
    """The ``Chat`` request.

    Raises:
        TypeError: A message is neither a dict nor a ``(role, content)`` pair.
    """
    return gateway_pb2.ChatRequest(
        messages=[_chat_message(m) for m in messages],
        adapter=adapter or "",
        sampling=sampling_params(sampling),
        first_token_deadline_ms=deadline_ms or 0.0,
        cache_salt=cache_salt or "",
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
            u.prompt_tokens,
            u.completion_tokens,
            u.first_token_ms,
            u.total_ms,
            u.resumes,
            u.migrations,
            u.cached_prompt_tokens,
        )
    return TextDelta(
        text=message.text,
        token_ids=tuple(message.token_ids),
        finish_reason=_FINISH_REASONS.get(message.finish_reason),
        usage=usage,
        request_id=message.request_id,
        served_by=served_from(message.served_by) if message.HasField("served_by") else None,
    )


def served_from(served: gateway_pb2.ServedVersion) -> ServedVersion:
    return ServedVersion(served.adapter, served.version, served.sha256, served.adapter_id, served.fingerprint)


def completion(deltas: list[TextDelta]) -> Completion:
    """A whole stream's deltas joined into one completion."""
    return Completion(
        text="".join(d.text for d in deltas),
        token_ids=tuple(t for d in deltas for t in d.token_ids),
        finish_reason=next((d.finish_reason for d in reversed(deltas) if d.finish_reason), None),
        usage=next((d.usage for d in reversed(deltas) if d.usage), None),
        request_id=next((d.request_id for d in deltas if d.request_id), ""),
        served_by=next((d.served_by for d in deltas if d.served_by), None),
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


def import_request(uri: str, name: str, public: bool) -> adapter_store_pb2.ImportAdapterRequest:
    """The ``ImportAdapter`` request (the owner is left empty: the gateway sets the caller's tenant)."""
    visibility = types_pb2.VISIBILITY_PUBLIC if public else types_pb2.VISIBILITY_PRIVATE
    return adapter_store_pb2.ImportAdapterRequest(uri=uri, name=name, visibility=visibility)


def imported_from(reply: adapter_store_pb2.ImportAdapterResponse) -> ImportedAdapter:
    return ImportedAdapter(adapter_from(reply.adapter), reply.changed)


def published_from(reply: adapter_store_pb2.RegisterAdapterResponse) -> PublishedVersion:
    adapter = adapter_from(reply.adapter)
    return PublishedVersion(adapter.version, adapter.id, adapter.sha256, reply.changed, adapter)


def pin_request(name: str, pinned: bool) -> gateway_pb2.GatewayPinRequest:
    """The ``SetAdapterPinned`` request for the caller's adapter ``name``."""
    return gateway_pb2.GatewayPinRequest(adapter=name, pinned=pinned)


def page_from(reply: adapter_store_pb2.ListAdaptersResponse) -> AdapterPage:
    return AdapterPage(tuple(adapter_from(a) for a in reply.adapters), reply.next_page_token, reply.total)
