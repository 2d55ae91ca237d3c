"""The cluster prefix tier over gRPC: the kv_manager's index (``AnnouncePrefixBlocks``,
``LocatePrefix``) and other workers' prefix caches (``FetchPrefixBlocks``), for
:class:`~services.gpu_worker.prefix_tier.ClusterPrefixTier`; and the holder's side of a fetch.

A fetch streams one block a message (a 16-token block of SmolLM2-135M in fp32 is 720 KiB, under
gRPC's 4 MiB default message limit, where a whole 1,000-token prompt's 46 MB would not be).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import torch
from grpc import aio

from mesh_api.v1 import kv_manager_pb2, kv_manager_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.gpu_worker.distkv.transport.lending_proto import tensor_from_proto, tensor_to_proto
from services.gpu_worker.engine.engine import Engine
from services.gpu_worker.memory.prefix_cache import BlockKey
from services.gpu_worker.prefix_tier import RemotePrefix
from services.runtime.errors import InvalidArgument, Unavailable
from services.runtime.rpc import keepalive
from services.runtime.rpc.interceptors import error_from_status
from services.runtime.security.tls import NO_TLS, TLSConfig, aio_channel

MAX_FETCH_KEYS = 4096
"""Keys one FetchPrefixBlocks may name (a 65,536-token prompt of 16-token blocks)."""


class _Channels:
    """One channel per address, kept."""

    def __init__(self, tls: TLSConfig):
        self.tls = tls
        self._channels: dict[str, aio.Channel] = {}

    def get(self, address: str) -> aio.Channel:
        if address not in self._channels:
            self._channels[address] = aio_channel(address, self.tls, keepalive.CHANNEL_OPTIONS)
        return self._channels[address]

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        await asyncio.gather(*(channel.close() for channel in channels.values()))


class GrpcPrefixDirectory:
    """The prefix index of the kv_manager replicas at ``addresses()`` (only the leader answers:
    each is asked in turn, as ``KvManagerDirectory`` does)."""

    def __init__(
        self, addresses: Callable[[], Sequence[str]], tls: TLSConfig = NO_TLS, deadline_s: float = 1.0
    ):
        """``deadline_s`` bounds each call: a lookup waits in front of a request's queueing, so a
        hung kv_manager costs at most this, then the request computes its prompt."""
        self.addresses = addresses
        self.deadline_s = deadline_s
        self._channels = _Channels(tls)

    async def announce(
        self, worker_id: str, kv_identity: str, added: list[BlockKey], removed: list[BlockKey], replace: bool
    ) -> str:
        request = kv_manager_pb2.AnnouncePrefixBlocksRequest(
            worker_id=worker_id, kv_identity=kv_identity, added=added, removed=removed, replace=replace
        )
        return (await self._call_leader("AnnouncePrefixBlocks", request)).index_id

    async def locate(self, worker_id: str, kv_identity: str, keys: Sequence[BlockKey]) -> RemotePrefix | None:
        request = kv_manager_pb2.LocatePrefixRequest(worker_id=worker_id, kv_identity=kv_identity, keys=keys)
        reply = await self._call_leader("LocatePrefix", request)
        return RemotePrefix(reply.holder_id, reply.address, reply.blocks) if reply.holder_id else None

    async def close(self) -> None:
        await self._channels.close()

    async def _call_leader(self, method: str, request):
        last = "no kv_manager is registered"
        for address in tuple(self.addresses()):
            stub = kv_manager_pb2_grpc.KVManagerStub(self._channels.get(address))
            try:
                return await getattr(stub, method)(request, timeout=self.deadline_s)
            except grpc.RpcError as error:
                last = f"{address}: {error.details() or error.code().name}"
                if error.code() != grpc.StatusCode.UNAVAILABLE:  # the leader answered: its word
                    raise error_from_status(error, f"{method} at {address}") from error
        raise Unavailable(f"{method}: no kv_manager leader answered (last: {last})")


class GrpcPrefixPeers:
    """Other workers' prefix caches, by address."""

    def __init__(self, tls: TLSConfig = NO_TLS):
        self._channels = _Channels(tls)

    async def fetch(
        self, address: str, kv_identity: str, keys: Sequence[BlockKey], deadline_s: float
    ) -> list[tuple[BlockKey, torch.Tensor]]:
        stub = worker_pb2_grpc.WorkerStub(self._channels.get(address))
        request = worker_pb2.FetchPrefixBlocksRequest(kv_identity=kv_identity, keys=keys)
        blocks = []
        try:
            async for reply in stub.FetchPrefixBlocks(request, timeout=deadline_s):
                blocks.append((reply.key, tensor_from_proto(reply.kv, "a prefix block")))
        except grpc.RpcError as error:
            raise error_from_status(error, f"FetchPrefixBlocks at {address}") from error
        return blocks

    async def close(self) -> None:
        await self._channels.close()


async def serve_prefix_blocks(
    engine: Engine, kv_identity: str, request: worker_pb2.FetchPrefixBlocksRequest
) -> AsyncIterator[worker_pb2.FetchPrefixBlocksResponse]:
    """The holder's answer: its cached blocks of the leading ``request.keys``, copied between two
    steps (no request writes a cached block, and none is evicted while it is copied)."""
    cache = engine.prefix_cache
    if request.kv_identity != kv_identity:
        raise InvalidArgument(
            f"kv_identity {request.kv_identity!r} is not this worker's ({kv_identity!r}): its KV blocks differ"
        )
    if len(request.keys) > MAX_FETCH_KEYS:
        raise InvalidArgument(
            f"{len(request.keys)} keys in one FetchPrefixBlocks, more than {MAX_FETCH_KEYS}"
        )
    if cache is None or not request.keys:
        return
    keys = list(request.keys)
    kv = await asyncio.wrap_future(engine.between_steps(lambda: cache.export_blocks(keys)))
    for key, block in zip(keys, kv, strict=False):
        yield worker_pb2.FetchPrefixBlocksResponse(key=key, kv=tensor_to_proto(block))
