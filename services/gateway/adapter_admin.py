"""Adapter administration through the gateway: upload, import, load from a directory, delete and
pin, each passed to the adapter store with the caller's tenant as owner. Loading from a directory
is an import of ``file://`` like any other (the tenant's import policy, no links, the upload size
limit: all the store's), of a directory the gateway first confines under ``--adapter-load-dirs``.
Each write drops the
catalog's cached lookup of its name and waits (briefly) until the catalog lists the change, so
its caller reads its own write (:mod:`services.gateway.adapter_catalog`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from mesh_api.adapter_transfer import is_import_uri, ref_by_name
from mesh_api.upload_wire import UploadMessage, header_wire
from mesh_api.v1 import adapter_store_pb2, types_pb2
from services.gateway.adapter_catalog import AdapterCatalog
from services.gateway.adapter_load_dirs import load_roots, resolve_adapter_dir
from services.gateway.adapter_reference import split_reference
from services.runtime.errors import AlreadyExists, PermissionDenied


class AdapterWrites(Protocol):
    """The adapter store's writes the gateway makes."""

    async def RegisterAdapter(
        self, requests: AsyncIterator[bytes]
    ) -> adapter_store_pb2.RegisterAdapterResponse: ...

    async def ImportAdapter(
        self, request: adapter_store_pb2.ImportAdapterRequest
    ) -> adapter_store_pb2.ImportAdapterResponse: ...

    async def DeleteAdapter(
        self, request: adapter_store_pb2.DeleteAdapterRequest
    ) -> adapter_store_pb2.DeleteAdapterResponse: ...

    async def SetAdapterPinned(
        self, request: adapter_store_pb2.SetAdapterPinnedRequest
    ) -> adapter_store_pb2.SetAdapterPinnedResponse: ...


class AdapterAdmin:
    """Adapter writes as the caller's tenant."""

    def __init__(self, store: AdapterWrites, catalog: AdapterCatalog, adapter_load_dirs: str = ""):
        """``adapter_load_dirs``: where ``lora_path`` may lead (the gateway's flag; "": nowhere)."""
        self._store = store
        self._catalog = catalog
        self._adapter_load_dirs = adapter_load_dirs

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
            reply = await self._store.RegisterAdapter(as_tenant())
        except asyncio.CancelledError:
            # grpc's asyncio client cancels the store's call when its request stream raises, and
            # awaiting it raises CancelledError: this RPC would end with no status (the caller
            # waited out its deadline). The caller gets what the stream raised instead.
            current = asyncio.current_task()
            if failed and (current is None or not current.cancelling()):
                raise failed[0] from None
            raise
        await self._registered(reply.adapter)
        return reply

    async def import_adapter(
        self, tenant: str, request: adapter_store_pb2.ImportAdapterRequest
    ) -> adapter_store_pb2.ImportAdapterResponse:
        """Have the store import ``request.uri`` for the caller's tenant, which owns it (the store
        checks the tenant's import policy)."""
        forwarded = adapter_store_pb2.ImportAdapterRequest()
        forwarded.CopyFrom(request)
        forwarded.owner = tenant
        reply = await self._store.ImportAdapter(forwarded)
        await self._registered(reply.adapter)
        return reply

    async def load_adapter(
        self, tenant: str, name: str, lora_path: str, inplace: bool = False
    ) -> types_pb2.AdapterInfo:
        """vLLM's ``load_lora_adapter``: an ``s3://``, ``hf://`` or ``file://`` URI is imported by
        the store; anything else is a path on the gateway's machine (:meth:`load_adapter_dir`).
        A name the tenant already has is refused ALREADY_EXISTS in vLLM's words unless
        ``inplace`` (vLLM's ``load_inplace``): then the content becomes the name's next version
        (the same content keeps the version it is)."""
        if not inplace and await self._catalog.registered(tenant, name):
            raise AlreadyExists(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True."
            )
        if is_import_uri(lora_path):
            request = adapter_store_pb2.ImportAdapterRequest(uri=lora_path, name=name)
            return (await self.import_adapter(tenant, request)).adapter
        return await self.load_adapter_dir(tenant, name, lora_path)

    async def load_adapter_dir(self, tenant: str, name: str, path: str) -> types_pb2.AdapterInfo:
        """Import the PEFT directory ``path`` as ``tenant``'s ``name``: under ``--adapter-load-dirs``
        only, a relative ``path`` looked up under each of them
        (:mod:`services.gateway.adapter_load_dirs`), then imported by the store as
        ``file://`` + its resolved path. So a tenant loads by path only what its import policy
        grants it (``loramesh up`` grants the load dirs to ``admin`` alone), files that are links
        or not regular are refused, and the store's upload size limit is checked on the listed
        sizes before any byte is read. The store reads the directory itself: it must see it at
        the same path (one machine under ``loramesh up``; the same volume in Kubernetes)."""
        directory = resolve_adapter_dir(path, load_roots(self._adapter_load_dirs))
        request = adapter_store_pb2.ImportAdapterRequest(uri=directory.as_uri(), name=name)
        return (await self.import_adapter(tenant, request)).adapter

    async def delete_adapter(self, tenant: str, adapter: str) -> adapter_store_pb2.DeleteAdapterResponse:
        """Delete one of the caller's own adapters."""
        ref = _own(tenant, adapter)
        reply = await self._store.DeleteAdapter(adapter_store_pb2.DeleteAdapterRequest(ref=ref))
        self._catalog.forget(ref.owned_name.owner, ref.owned_name.name)
        await self._catalog.shows(reply.adapter.id, present=False)
        return reply

    async def set_adapter_pinned(
        self, tenant: str, adapter: str, pinned: bool
    ) -> adapter_store_pb2.SetAdapterPinnedResponse:
        """Pin (or unpin) one of the caller's own adapters: the store and the workers never evict it."""
        ref = _own(tenant, adapter)
        reply = await self._store.SetAdapterPinned(
            adapter_store_pb2.SetAdapterPinnedRequest(ref=ref, pinned=pinned)
        )
        self._catalog.forget(ref.owned_name.owner, ref.owned_name.name)
        return reply

    async def _registered(self, adapter: types_pb2.AdapterInfo) -> None:
        self._catalog.forget(adapter.owner, adapter.name)
        await self._catalog.shows(adapter.id, present=True)


def _own(tenant: str, adapter: str) -> adapter_store_pb2.AdapterRef:
    """The store's reference to ``adapter``, which must be ``tenant``'s own: PermissionDenied else."""
    owner, name = split_reference(tenant, adapter)
    if owner != tenant:
        raise PermissionDenied(f"adapter {adapter!r} belongs to tenant {owner!r}")
    return ref_by_name(owner, name)
