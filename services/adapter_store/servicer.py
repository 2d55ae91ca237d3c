"""``loramesh.v1.AdapterStore``: translates proto <-> repository calls, nothing more.

Repository calls block on disk and hashing, so each runs in a worker thread; the event loop
only moves messages.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from grpc import aio

from mesh_api.upload_wire import UploadMessage
from mesh_api.v1 import adapter_store_pb2 as pb
from mesh_api.v1 import adapter_store_pb2_grpc, types_pb2
from services.adapter_store.adapter_imports import AdapterImports
from services.adapter_store.adapter_record import AdapterRecord
from services.adapter_store.blobs.page_aligned import page_aligned_join
from services.adapter_store.catalog_changes import CatalogChange
from services.adapter_store.chat_templates import TOKENIZER_FILES
from services.adapter_store.ram_tier import RamTier
from services.adapter_store.registrar import AdapterUpload, check_name
from services.adapter_store.repository import AdapterKey, AdapterRepository
from services.adapter_store.tenant_storage_quota import UploadAdmission
from services.runtime.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from services.runtime.field_copy import message_of
from services.runtime.process.file_system import file_system_identity
from services.runtime.rpc.fetch_hints import RAM_TIER_ONLY

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
FETCH_CHUNK_BYTES = 1 << 20
WATCH_PAGE_SIZE = 500
"""Adapters per ``WatchAdapters`` message, in the first listing and in a burst of changes."""
MAX_WATCH_BACKLOG = 100_000
"""Changes a ``WatchAdapters`` stream may fall behind before it is ended (the watcher lists again)."""


def record_to_proto(record: AdapterRecord, with_chat_templates: bool = True) -> types_pb2.AdapterInfo:
    """``with_chat_templates`` false leaves the templates out (listings and fetches, which do not
    need them, stay small)."""
    return message_of(
        types_pb2.AdapterInfo,
        record,
        pet_type=types_pb2.PET_TYPE_LORA,
        created_unix_ms=record.created_ms,
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


@dataclass(frozen=True)
class ReceivedUpload:
    """An upload's header and its files' chunks as they arrived (views, not yet joined)."""

    header: pb.RegisterAdapterRequest.Header
    chunks: dict[str, list[memoryview]]

    def file(self, name: str) -> bytes:
        return b"".join(self.chunks[name])

    def weights(self, for_ram_tier: bool) -> memoryview:
        """The weights file joined where the blob store writes it from without another copy;
        ``for_ram_tier``: in a mapping, which the RAM tier keeps as it is (filling a fresh one
        costs ~3 ms more for 10 MB than reused heap memory, a copy into the RAM tier ~4.5)."""
        return page_aligned_join(self.chunks[WEIGHTS_FILE], mapped=for_ram_tier)

    def weights_size(self) -> int:
        return sum(len(chunk) for chunk in self.chunks[WEIGHTS_FILE])

    def tokenizer_files(self) -> dict[str, bytes]:
        return {name: self.file(name) for name in TOKENIZER_FILES if self.chunks[name]}


async def receive_header(
    requests: AsyncIterator[UploadMessage], max_bytes: int
) -> pb.RegisterAdapterRequest.Header:
    """The upload's first message, its header; an upload declaring more than ``max_bytes`` is
    refused before any file arrives."""
    message = await anext(requests, None)
    if message is None:
        raise InvalidArgument("RegisterAdapter received no header")
    if message.header is None:
        raise InvalidArgument("the first message of RegisterAdapter must be a header")
    header = message.header
    if header.total_bytes > max_bytes:
        raise ResourceExhausted(
            f"upload of {header.total_bytes} bytes is over the size limit of {max_bytes} bytes"
        )
    return header


async def receive_files(
    requests: AsyncIterator[UploadMessage],
    header: pb.RegisterAdapterRequest.Header,
    max_bytes: int,
    admission: UploadAdmission,
) -> ReceivedUpload:
    """Collect the two adapter files and the tokenizer files the upload has (optional), after
    its header, refusing early an upload over the size limit or over the room its tenant has
    left (the runtime's interceptor reads the rest of a refused stream before the answer goes)."""
    chunks: dict[str, list[memoryview]] = {name: [] for name in (CONFIG_FILE, WEIGHTS_FILE, *TOKENIZER_FILES)}
    received = kept = 0
    async for message in requests:
        if message.header is not None:
            raise InvalidArgument("only one header is allowed, as the first message")
        filename = message.filename
        if filename == "adapter_model.bin":
            raise InvalidArgument(
                "adapter_model.bin (pickle) is not accepted: upload adapter_model.safetensors"
            )
        if filename not in chunks:
            continue  # README.md, training args and the like are not needed to serve
        received += len(message.data)
        if received > max_bytes:
            raise ResourceExhausted(f"upload is over the size limit of {max_bytes} bytes")
        if filename in (CONFIG_FILE, WEIGHTS_FILE):
            kept += len(message.data)
            admission.check_received(kept)
        chunks[filename].append(message.data)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not any(chunks[name]):
            raise InvalidArgument(f"the upload has no {name}")
    return ReceivedUpload(header, chunks)


@contextlib.contextmanager
def ram_ahead_of_commit(ram: RamTier, sha256: str, weights: memoryview) -> Iterator[None]:
    """A new version's weights in the RAM tier before its row commits, taken out again if the
    registration fails (unless they were there before). Every worker's pull starts when the
    row reaches its etcd watch, before the commit returns here: kept only after it (as the
    registrar does), a fetch that came first found the RAM tier without them and read the blob
    back from disk and hashed it again (4 fetches of 12 right after their publish, in-process).
    Only a committed row makes them servable: a fetch resolves the id first."""
    held = sha256 in ram
    ram.put(sha256, weights)
    try:
        yield
    except BaseException:
        if not held:
            ram.discard(sha256)
        raise


class AdapterStoreServicer(adapter_store_pb2_grpc.AdapterStoreServicer):
    """Serves RPCs once :meth:`attach` has given it an opened repository."""

    def __init__(self) -> None:
        self._repository: AdapterRepository | None = None
        self._imports: AdapterImports | None = None
        self.uploads_in_flight = 0
        self._closing = asyncio.Event()
        """Set when shutdown begins: every ``WatchAdapters`` stream ends."""

    def attach(self, repository: AdapterRepository, imports: AdapterImports) -> None:
        self._repository = repository
        self._imports = imports

    def end_watches(self) -> None:
        self._closing.set()

    @property
    def repository(self) -> AdapterRepository:
        if self._repository is None:
            raise Unavailable("the adapter store is starting: its catalog is not loaded yet")
        return self._repository

    async def RegisterAdapter(self, request_iterator, context: aio.ServicerContext):
        repository = self.repository
        self.uploads_in_flight += 1
        try:
            messages = aiter(request_iterator)
            header = await receive_header(messages, repository.limits.max_adapter_bytes)
            check_name("owner", header.owner)
            # The tenant's room and one of its upload slots, before its bytes are held here (on
            # a thread only when that reads etcd).
            quota = repository.quota
            inline = quota.admits_without_etcd(header.owner)
            # A publish to a name the tenant holds adds a version, not an adapter.
            new_adapter = not header.new_version or (
                repository.catalog.mirror.get_by_name(header.owner, header.name) is None
            )
            admission = (
                quota.admit(header.owner, new_adapter)
                if inline
                else await asyncio.to_thread(quota.admit, header.owner, new_adapter)
            )
            try:
                upload = await receive_files(messages, header, repository.limits.max_adapter_bytes, admission)
                record, changed = await asyncio.to_thread(self._register, upload)
            finally:
                if inline:
                    admission.release()
                else:
                    await asyncio.to_thread(admission.release)
        finally:
            self.uploads_in_flight -= 1
        return pb.RegisterAdapterResponse(adapter=record_to_proto(record), changed=changed)

    def _register(self, upload: ReceivedUpload) -> tuple[AdapterRecord, bool]:
        """On a worker thread: joining the files is a copy the event loop does not make. A
        publish (``new_version``) registers as an import does: a new version of a name."""
        header = upload.header
        ram = self.repository.ram
        adapter = AdapterUpload(
            header.name,
            header.owner,
            int(header.visibility),
            upload.file(CONFIG_FILE),
            upload.weights(for_ram_tier=header.new_version and upload.weights_size() <= ram.budget_bytes),
            upload.tokenizer_files(),
        )
        if not header.new_version:
            return self.repository.registrar.register(adapter), True
        with ram_ahead_of_commit(ram, adapter.sha256, adapter.weights):
            registration = self.repository.registrar.register_version(adapter)
        return registration.record, registration.changed

    async def ImportAdapter(self, request: pb.ImportAdapterRequest, context):
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

    async def WatchAdapters(self, request: pb.WatchAdaptersRequest, context):
        """Every adapter (each name's kept versions too, as a watch of the rows in etcd sees
        them), then every change: subscribed before the listing starts, so a change committed
        meanwhile is in the listing, in the changes after it, or both (applying a change twice
        leaves a copy as once)."""
        repository = self.repository
        loop = asyncio.get_running_loop()
        changes: asyncio.Queue[CatalogChange] = asyncio.Queue()

        def deliver(change: CatalogChange) -> None:  # on the committing thread
            with contextlib.suppress(RuntimeError):  # the loop is closing: the stream is gone
                loop.call_soon_threadsafe(changes.put_nowait, change)

        unsubscribe = repository.changes.subscribe(deliver)
        try:
            token = ""
            while True:
                records, token, _ = await asyncio.to_thread(
                    repository.list, "", False, WATCH_PAGE_SIZE, token, True
                )
                yield pb.WatchAdaptersResponse(
                    upserted=[record_to_proto(r, with_chat_templates=False) for r in records],
                    synced=not token,
                )
                if not token:
                    break
            while (change := await self._next_change(changes)) is not None:
                batch = [change]
                while not changes.empty() and len(batch) < WATCH_PAGE_SIZE:
                    batch.append(changes.get_nowait())
                yield pb.WatchAdaptersResponse(
                    upserted=[
                        record_to_proto(c.upserted, with_chat_templates=False) for c in batch if c.upserted
                    ],
                    deleted_ids=[c.deleted_id for c in batch if c.deleted_id],
                    synced=True,
                )
                if changes.qsize() > MAX_WATCH_BACKLOG:
                    raise Unavailable(
                        f"this watcher fell {changes.qsize()} changes behind the catalog: watch again"
                    )
        finally:
            unsubscribe()

    async def _next_change(self, changes: asyncio.Queue[CatalogChange]) -> CatalogChange | None:
        """The next change, or None once shutdown has begun (:meth:`end_watches`)."""
        if self._closing.is_set():
            return None
        getter = asyncio.ensure_future(changes.get())
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            done, _ = await asyncio.wait((getter, closing), return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
            if not getter.done():
                getter.cancel()
        return getter.result() if getter in done else None

    async def DeleteAdapter(self, request: pb.DeleteAdapterRequest, context):
        record = await asyncio.to_thread(self.repository.delete, key_from_proto(request.ref))
        return pb.DeleteAdapterResponse(adapter=record_to_proto(record))

    async def SetAdapterPinned(self, request: pb.SetAdapterPinnedRequest, context):
        record = await asyncio.to_thread(
            self.repository.set_pinned, key_from_proto(request.ref), request.pinned
        )
        return pb.SetAdapterPinnedResponse(adapter=record_to_proto(record))

    async def ListPinnedAdapters(self, request, context):
        ids = await asyncio.to_thread(self.repository.pinned_ids)
        return pb.ListPinnedAdaptersResponse(adapter_ids=ids)

    async def FetchAdapter(self, request: pb.FetchAdapterRequest, context):
        record = await asyncio.to_thread(self.repository.resolve, key_from_proto(request.ref))
        # A caller on this file system reads the blob's file itself: nothing is copied here,
        # nothing streamed (10 MB cost the two ends about 30 ms of CPU over gRPC).
        if request.file_system and request.file_system == file_system_identity():
            path = await asyncio.to_thread(self.repository.weights_file, record)
            if path is not None:
                yield self._fetch_header(record, record.size_bytes, blob_path=str(path))
                return
        if (
            RAM_TIER_ONLY in (context.invocation_metadata() or ())
            and record.sha256 not in self.repository.ram
        ):
            raise FailedPrecondition(
                f"adapter {record.id!r} is not in this replica's RAM tier (asked for it from there only)"
            )
        data = await asyncio.to_thread(self.repository.read_weights, record)
        yield self._fetch_header(record, len(data))
        view = memoryview(data)
        for start in range(0, len(data), FETCH_CHUNK_BYTES):
            yield pb.FetchAdapterResponse(chunk=bytes(view[start : start + FETCH_CHUNK_BYTES]))

    @staticmethod
    def _fetch_header(
        record: AdapterRecord, total_bytes: int, blob_path: str = ""
    ) -> pb.FetchAdapterResponse:
        return pb.FetchAdapterResponse(
            header=pb.FetchAdapterResponse.Header(
                adapter=record_to_proto(record, with_chat_templates=False),
                total_bytes=total_bytes,
                sha256=record.sha256,
                blob_path=blob_path,
            )
        )

    async def Stats(self, request, context):
        stats = await asyncio.to_thread(self.repository.stats)
        return message_of(pb.StatsResponse, stats, uploads_in_flight=self.uploads_in_flight)
