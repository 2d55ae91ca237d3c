"""``loramesh.v1.AdapterStore``: translates proto <-> repository calls, nothing more.

Repository calls block on disk and hashing, so each runs in a worker thread; the event loop
only moves messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from grpc import aio

from mesh_api.v1 import adapter_store_pb2 as pb
from mesh_api.v1 import adapter_store_pb2_grpc, types_pb2
from services.adapter_store.adapter_imports import AdapterImports
from services.adapter_store.catalog import AdapterRecord
from services.adapter_store.chat_templates import TOKENIZER_FILES
from services.adapter_store.owner_rule import check_owner_setter
from services.adapter_store.repository import AdapterKey, AdapterRepository
from services.runtime.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.runtime.tls import peer_identity_var

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
FETCH_CHUNK_BYTES = 1 << 20


def record_to_proto(record: AdapterRecord, with_chat_templates: bool = True) -> types_pb2.AdapterInfo:
    """``with_chat_templates`` false leaves the templates out (listings and fetches, which do not
    need them, stay small)."""
    return types_pb2.AdapterInfo(
        id=record.id,
        name=record.name,
        owner=record.owner,
        visibility=record.visibility,
        base_model=record.base_model,
        pet_type=types_pb2.PET_TYPE_LORA,
        rank=record.rank,
        max_rank=record.max_rank,
        lora_alpha=record.lora_alpha,
        use_rslora=record.use_rslora,
        target_modules=list(record.target_modules),
        dtype=record.dtype,
        size_bytes=record.size_bytes,
        sha256=record.sha256,
        version=record.version,
        created_unix_ms=record.created_ms,
        config_json=record.config_json,
        chat_template=record.chat_template if with_chat_templates else "",
        tool_use_chat_template=record.tool_use_chat_template if with_chat_templates else "",
    )


def key_from_proto(ref: pb.AdapterRef) -> AdapterKey:
    which = ref.WhichOneof("ref")
    if which == "id":
        return AdapterKey(id=ref.id)
    if which == "owned_name":
        return AdapterKey(owner=ref.owned_name.owner, name=ref.owned_name.name)
    raise InvalidArgument("ref is required: an adapter id or an owner and name")


async def receive_upload(
    requests: AsyncIterator[pb.RegisterAdapterRequest], max_bytes: int
) -> tuple[pb.RegisterAdapterRequest.Header, dict[str, bytes]]:
    """Collect the header, the two adapter files and the tokenizer files the upload has
    (optional), refusing oversize uploads early."""
    header = None
    parts: dict[str, list[bytes]] = {name: [] for name in (CONFIG_FILE, WEIGHTS_FILE, *TOKENIZER_FILES)}
    received = 0
    async for message in requests:
        kind = message.WhichOneof("item")
        if header is None:
            if kind != "header":
                raise InvalidArgument("the first message of RegisterAdapter must be a header")
            header = message.header
            if header.total_bytes > max_bytes:
                raise ResourceExhausted(
                    f"upload of {header.total_bytes} bytes is over the size limit of {max_bytes} bytes"
                )
            continue
        if kind != "chunk":
            raise InvalidArgument("only one header is allowed, as the first message")
        filename = message.chunk.filename
        if filename == "adapter_model.bin":
            raise InvalidArgument(
                "adapter_model.bin (pickle) is not accepted: upload adapter_model.safetensors"
            )
        if filename not in parts:
            continue  # README.md, training args and the like are not needed to serve
        received += len(message.chunk.data)
        if received > max_bytes:
            raise ResourceExhausted(f"upload is over the size limit of {max_bytes} bytes")
        parts[filename].append(message.chunk.data)
    if header is None:
        raise InvalidArgument("RegisterAdapter received no header")
    files = {name: b"".join(chunks) for name, chunks in parts.items() if chunks}
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not files.get(name):
            raise InvalidArgument(f"the upload has no {name}")
    return header, files


class AdapterStoreServicer(adapter_store_pb2_grpc.AdapterStoreServicer):
    """Serves RPCs once :meth:`attach` has given it an opened repository."""

    def __init__(self) -> None:
        self._repository: AdapterRepository | None = None
        self._imports: AdapterImports | None = None
        self.uploads_in_flight = 0

    def attach(self, repository: AdapterRepository, imports: AdapterImports) -> None:
        self._repository = repository
        self._imports = imports

    @property
    def repository(self) -> AdapterRepository:
        if self._repository is None:
            raise Unavailable("the adapter store is starting: its catalog is not loaded yet")
        return self._repository

    async def RegisterAdapter(self, request_iterator, context: aio.ServicerContext):
        self.uploads_in_flight += 1
        try:
            header, files = await receive_upload(request_iterator, self.repository.limits.max_adapter_bytes)
            # Checked once the (size-bounded) stream is read: a status sent while the client still
            # writes can reach it as INTERNAL instead of the refusal.
            check_owner_setter(peer_identity_var.get(), "register an adapter for an owner")
            record = await asyncio.to_thread(
                self.repository.register,
                header.name,
                header.owner,
                int(header.visibility),
                files[CONFIG_FILE],
                files[WEIGHTS_FILE],
                {name: files[name] for name in TOKENIZER_FILES if name in files},
            )
        finally:
            self.uploads_in_flight -= 1
        return pb.RegisterAdapterResponse(adapter=record_to_proto(record))

    async def ImportAdapter(self, request: pb.ImportAdapterRequest, context):
        check_owner_setter(peer_identity_var.get(), "import an adapter for an owner")
        imports = self._imports
        if imports is None:
            raise Unavailable("the adapter store is starting: its catalog is not loaded yet")
        self.uploads_in_flight += 1  # an import holds up to an upload's bytes in memory too
        try:
            registration = await asyncio.to_thread(
                imports.import_adapter, request.uri, request.name, request.owner, int(request.visibility)
            )
        finally:
            self.uploads_in_flight -= 1
        return pb.ImportAdapterResponse(
            adapter=record_to_proto(registration.record), changed=registration.changed
        )

    async def GetAdapter(self, request: pb.GetAdapterRequest, context):
        record = await asyncio.to_thread(self.repository.resolve, key_from_proto(request.ref))
        return record_to_proto(record)

    async def ListAdapters(self, request: pb.ListAdaptersRequest, context):
        records, token, total = await asyncio.to_thread(
            self.repository.list, request.owner, request.include_public, request.page_size, request.page_token
        )
        return pb.ListAdaptersResponse(
            adapters=[record_to_proto(r, with_chat_templates=False) for r in records],
            next_page_token=token,
            total=total,
        )

    async def DeleteAdapter(self, request: pb.DeleteAdapterRequest, context):
        check_owner_setter(peer_identity_var.get(), "delete an owner's adapter")
        record = await asyncio.to_thread(self.repository.delete, key_from_proto(request.ref))
        return pb.DeleteAdapterResponse(adapter=record_to_proto(record))

    async def FetchAdapter(self, request: pb.FetchAdapterRequest, context):
        record = await asyncio.to_thread(self.repository.resolve, key_from_proto(request.ref))
        data = await asyncio.to_thread(self.repository.read_weights, record)
        yield pb.FetchAdapterResponse(
            header=pb.FetchAdapterResponse.Header(
                adapter=record_to_proto(record, with_chat_templates=False),
                total_bytes=len(data),
                sha256=record.sha256,
            )
        )
        view = memoryview(data)
        for start in range(0, len(data), FETCH_CHUNK_BYTES):
            yield pb.FetchAdapterResponse(chunk=bytes(view[start : start + FETCH_CHUNK_BYTES]))

    async def Stats(self, request, context):
        stats = await asyncio.to_thread(self.repository.stats)
        return pb.StatsResponse(
            adapters=stats.adapters,
            disk_bytes=stats.disk_bytes,
            ram_bytes=stats.ram_bytes,
            ram_budget_bytes=stats.ram_budget_bytes,
            ram_adapters=stats.ram_adapters,
            ram_hits=stats.ram_hits,
            ram_misses=stats.ram_misses,
            uploads_in_flight=self.uploads_in_flight,
        )
