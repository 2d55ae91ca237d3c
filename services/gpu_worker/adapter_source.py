"""Where a worker gets an adapter's files, and which adapters are pinned: the adapter store, or a
local directory (which pins none)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc

from mesh_api.adapter_transfer import ChecksumMismatch, fetch_adapter_chunks, ref_by_id
from mesh_api.v1 import adapter_store_pb2, adapter_store_pb2_grpc, types_pb2
from services.runtime.errors import DataLoss, NotFound, Unavailable
from services.runtime.etcd.discovery import (
    ANSWER_WITHIN_S,
    ChannelPool,
    MemberUnavailable,
    ServiceLocator,
    first_answer,
)
from services.runtime.process.file_system import file_system_identity
from services.runtime.process.mapped_memory import read_file_mapped
from services.runtime.rpc.fetch_hints import RAM_TIER_ONLY
from services.runtime.security.tls import NO_TLS, TLSConfig

log = logging.getLogger("loramesh.gpu_worker")


@dataclass(frozen=True)
class FetchedAdapter:
    """One adapter as a source hands it over."""

    config: bytes
    """``adapter_config.json``."""
    weights: bytes | bytearray | list[bytes | memoryview]
    """``adapter_model.safetensors``: whole, or the chunks it was fetched in (parsed where they
    are, not joined)."""
    pinned: bool = False
    """Pinned when it was fetched (never evicted from this worker's host cache or pool)."""
    weights_sha256: str | None = None
    """The weights' sha256, verified on the way in (None: not known; the parse hashes them)."""


class AdapterSource(Protocol):
    async def fetch(self, adapter_id: str, just_published: bool = False) -> FetchedAdapter:
        """The files of ``adapter_id``, and whether it is pinned. ``just_published``: its row
        was created a moment ago (a version pulled as soon as it is published)."""
        ...

    async def pinned_ids(self) -> frozenset[str]:
        """The ids of every adapter pinned now."""
        ...

    def public_name(self, adapter_id: str) -> str:
        """The name users call a fetched adapter by (in metrics labels); its id if unknown."""
        ...

    async def close(self) -> None: ...


class LocalBlobFiles:
    """The store's blob files, read where a replica on this file system names one: past the page
    cache (the store wrote it that way) into a fresh mapping, then checked against its sha256. A
    10 MB version costs the read's 0.4 ms and the hash's 5.6 ms of CPU, against about 30 ms for
    both ends of a gRPC stream (AMD EPYC, 2 vCPUs)."""

    def __init__(self):
        self.file_system = file_system_identity()

    async def read(self, path: str, size: int, sha256: str) -> memoryview | None:
        return await asyncio.to_thread(_checked_file, path, size, sha256)


def _checked_file(path: str, size: int, sha256: str) -> memoryview | None:
    try:
        data = read_file_mapped(path)
    except OSError as error:  # not readable from here (permissions), or collected meanwhile
        log.info("blob file %s not read (%s): streamed instead", path, error)
        return None
    if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
        log.warning(
            "blob file %s does not hold the %d bytes of sha256 %s: streamed instead", path, size, sha256
        )
        return None
    return data


_NOT_IN_RAM_TIER = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
"""A replica's answers to a fetch asked of its RAM tier only, when another replica may hold the
version there: not in its RAM tier, or its copy of the catalog not yet at the version's row."""


class _RamTierOnly:
    """A store stub whose ``FetchAdapter`` calls carry :data:`~services.runtime.rpc.fetch_hints.RAM_TIER_ONLY`."""

    def __init__(self, stub: adapter_store_pb2_grpc.AdapterStoreStub):
        self._stub = stub

    def FetchAdapter(self, request: adapter_store_pb2.FetchAdapterRequest, **kwargs):
        return self._stub.FetchAdapter(request, metadata=(RAM_TIER_ONLY,), **kwargs)


class DirectorySource:
    """Standalone mode: ``<root>/<adapter_id>/`` holds a PEFT adapter."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    async def fetch(self, adapter_id: str, just_published: bool = False) -> FetchedAdapter:
        directory = self.root / adapter_id
        if "/" in adapter_id or adapter_id.startswith(".") or not directory.is_dir():
            raise NotFound(f"adapter {adapter_id!r} is not in {self.root}")
        config = directory / "adapter_config.json"
        weights = directory / "adapter_model.safetensors"
        if not config.exists() or not weights.exists():
            raise NotFound(f"{directory} lacks adapter_config.json or adapter_model.safetensors")
        return await asyncio.to_thread(lambda: FetchedAdapter(config.read_bytes(), weights.read_bytes()))

    async def pinned_ids(self) -> frozenset[str]:
        return frozenset()  # no API pins a directory's adapters

    def public_name(self, adapter_id: str) -> str:
        return adapter_id  # its directory's name

    async def close(self) -> None:
        pass


class StoreSource:
    """Pull from the adapter store (address given, or a member listed in etcd)."""

    def __init__(
        self,
        address: str = "",
        etcd_endpoints: str = "",
        tls: TLSConfig = NO_TLS,
        *,
        read_blob_files: bool = True,
    ):
        """``read_blob_files``: offer each replica to name its blob file instead of streaming
        it (``--store-fetch auto``); a replica on another file system streams it anyway."""
        self._locator = ServiceLocator("adapter_store", address, etcd_endpoints, tls)
        self._channels = ChannelPool(tls)
        self._names: dict[str, str] = {}
        self._blob_files = LocalBlobFiles() if read_blob_files else None

    async def fetch(self, adapter_id: str, just_published: bool = False) -> FetchedAdapter:
        """Fetched from a live store replica: one that fails UNAVAILABLE (before or during the
        download), or sends nothing within :data:`ANSWER_WITHIN_S` (hung), is left for another,
        which sends it from the start.

        ``just_published``: the replicas are asked first for the weights from their RAM tier
        only (:data:`~services.runtime.rpc.fetch_hints.RAM_TIER_ONLY`), so the replica that committed the
        version sends them, not one that would read its blob from disk and hash it again; a
        replica without them there (FAILED_PRECONDITION), or without the row yet (NOT_FOUND),
        is left for the next, and when none sends them, they are fetched as any other. The
        locator keeps the replica that sent them: the next version, committed by the same
        replica while the same gateway relays the publishes, is found there at the first try."""
        if just_published:
            with contextlib.suppress(Unavailable, NotFound):
                return await self._fetch(adapter_id, ram_tier_only=True)
        return await self._fetch(adapter_id, ram_tier_only=False)

    async def _fetch(self, adapter_id: str, ram_tier_only: bool) -> FetchedAdapter:
        async def attempt(address: str, within_s: float | None) -> tuple[types_pb2.AdapterInfo, list[bytes]]:
            what = f"adapter store at {address}"
            stub = self._stub(address)
            try:
                return await fetch_adapter_chunks(
                    _RamTierOnly(stub) if ram_tier_only else stub,
                    ref_by_id(adapter_id),
                    first_answer=lambda read: first_answer(read, within_s, what),
                    blob_files=self._blob_files,
                )
            except ChecksumMismatch as error:
                raise DataLoss(str(error)) from None
            except grpc.RpcError as error:
                if ram_tier_only and error.code() in _NOT_IN_RAM_TIER:
                    raise MemberUnavailable(f"{what}: {error.code().name}: {error.details()}") from None
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    raise NotFound(f"adapter {adapter_id!r} not found in the adapter store") from None
                raise await self._failure(address, error) from None

        info, data = await self._locator.on_answering_member(attempt, ANSWER_WITHIN_S)
        self._names[adapter_id] = f"{info.owner}/{info.name}"
        return FetchedAdapter(info.config_json.encode(), data, info.pinned, info.sha256 or None)

    async def pinned_ids(self) -> frozenset[str]:
        """The store's pinned adapters (Unavailable when no replica answers)."""

        async def attempt(
            address: str, within_s: float | None
        ) -> adapter_store_pb2.ListPinnedAdaptersResponse:
            request = adapter_store_pb2.ListPinnedAdaptersRequest()
            try:
                return await first_answer(
                    self._stub(address).ListPinnedAdapters(request, timeout=10),
                    within_s,
                    f"adapter store at {address}",
                )
            except grpc.RpcError as error:
                raise await self._failure(address, error) from None

        reply = await self._locator.on_answering_member(attempt, ANSWER_WITHIN_S)
        return frozenset(reply.adapter_ids)

    def _stub(self, address: str) -> adapter_store_pb2_grpc.AdapterStoreStub:
        return adapter_store_pb2_grpc.AdapterStoreStub(self._channels.get(address))

    async def _failure(self, address: str, error: grpc.RpcError) -> Unavailable:
        """What a replica's failure raises: UNAVAILABLE is tried on another replica at once; after
        any other the next call may find another store."""
        message = f"adapter store at {address}: {error.code().name}: {error.details()}"
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            return MemberUnavailable(message)
        await self._locator.address(refresh=True, avoid=address)
        return Unavailable(message)

    def public_name(self, adapter_id: str) -> str:
        """``owner/name``: the OpenAI ``model`` that names it for every tenant allowed to use it."""
        return self._names.get(adapter_id, adapter_id)

    async def close(self) -> None:
        await self._channels.close()
