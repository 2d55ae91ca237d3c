"""Where a worker gets an adapter's files: the adapter store, or a local directory."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol

import grpc

from mesh_api.adapter_transfer import ChecksumMismatch, fetch_adapter, ref_by_id
from mesh_api.v1 import adapter_store_pb2_grpc
from services.runtime.discovery import ChannelPool, ServiceLocator
from services.runtime.errors import DataLoss, NotFound, Unavailable
from services.runtime.tls import NO_TLS, TLSConfig


class AdapterSource(Protocol):
    async def fetch(self, adapter_id: str) -> tuple[bytes, bytes]:
        """``(adapter_config.json, adapter_model.safetensors)`` of ``adapter_id``."""
        ...

    def public_name(self, adapter_id: str) -> str:
        """The name users call a fetched adapter by (in metrics labels); its id if unknown."""
        ...

    async def close(self) -> None: ...


class DirectorySource:
    """Standalone mode: ``<root>/<adapter_id>/`` holds a PEFT adapter."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    async def fetch(self, adapter_id: str) -> tuple[bytes, bytes]:
        directory = self.root / adapter_id
        if "/" in adapter_id or adapter_id.startswith(".") or not directory.is_dir():
            raise NotFound(f"adapter {adapter_id!r} is not in {self.root}")
        config = directory / "adapter_config.json"
        weights = directory / "adapter_model.safetensors"
        if not config.exists() or not weights.exists():
            raise NotFound(f"{directory} lacks adapter_config.json or adapter_model.safetensors")
        return await asyncio.to_thread(lambda: (config.read_bytes(), weights.read_bytes()))

    def public_name(self, adapter_id: str) -> str:
        return adapter_id  # its directory's name

    async def close(self) -> None:
        pass


class StoreSource:
    """Pull from the adapter store (address given, or a member listed in etcd)."""

    def __init__(self, address: str = "", etcd_endpoints: str = "", tls: TLSConfig = NO_TLS):
        self._locator = ServiceLocator("adapter_store", address, etcd_endpoints, tls)
        self._channels = ChannelPool(tls)
        self._names: dict[str, str] = {}

    async def fetch(self, adapter_id: str) -> tuple[bytes, bytes]:
        address = await self._locator.address()
        stub = adapter_store_pb2_grpc.AdapterStoreStub(self._channels.get(address))
        try:
            info, data = await fetch_adapter(stub, ref_by_id(adapter_id))
        except ChecksumMismatch as error:
            raise DataLoss(str(error)) from None
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"adapter {adapter_id!r} not found in the adapter store") from None
            await self._locator.address(refresh=True)  # the next pull may find another store
            raise Unavailable(f"adapter store: {error.code().name}: {error.details()}") from None
        self._names[adapter_id] = f"{info.owner}/{info.name}"
        return info.config_json.encode(), data

    def public_name(self, adapter_id: str) -> str:
        """``owner/name``: the OpenAI ``model`` that names it for every tenant allowed to use it."""
        return self._names.get(adapter_id, adapter_id)

    async def close(self) -> None:
        await self._channels.close()
