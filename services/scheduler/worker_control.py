"""The workers' migration RPCs (``ListRequests``, ``LoadAdapter``, ``HandOff``) as the
:class:`~services.scheduler.rebalancing.WorkerControl` the rebalancer drives.

A worker's status comes back as the domain error it raised (``NOT_FOUND`` -> ``NotFound``...);
one that cannot be reached or misses the deadline is ``Unavailable``.
"""

from __future__ import annotations

from types import MappingProxyType

from grpc import aio

from mesh_api.v1 import worker_pb2, worker_pb2_grpc
from services.runtime.etcd.discovery import ChannelPool
from services.runtime.field_copy import dataclass_of
from services.runtime.rpc.interceptors import error_from_status
from services.scheduler.policies.replica_load import RequestLoad
from services.scheduler.rebalancing import WorkerRequests


def worker_requests_from_proto(reply: worker_pb2.ListRequestsResponse) -> WorkerRequests:
    return dataclass_of(
        WorkerRequests,
        reply,
        requests=tuple(dataclass_of(RequestLoad, r) for r in reply.requests),
        waited_s=MappingProxyType({r.request_id: r.waited_s for r in reply.requests}),
        held_adapters=frozenset(reply.held_adapters),
        adapter_tokens=MappingProxyType(dict(reply.adapter_tokens)),
    )


class GrpcWorkerControl:
    """Worker calls over the scheduler's channel pool; ``deadline_s`` bounds each one (a listing
    or a hand-off waits for the worker's current step, a load for the adapter's fetch)."""

    def __init__(self, channels: ChannelPool, deadline_s: float):
        self.channels = channels
        self.deadline_s = deadline_s

    async def list_requests(self, address: str) -> WorkerRequests:
        reply = await self._call(address, "ListRequests", worker_pb2.ListRequestsRequest())
        return worker_requests_from_proto(reply)

    async def load_adapter(self, address: str, adapter_id: str) -> None:
        await self._call(address, "LoadAdapter", worker_pb2.LoadAdapterRequest(adapter_id=adapter_id))

    async def hand_off(self, address: str, request_id: str, target_worker_id: str) -> int:
        request = worker_pb2.HandOffRequest(request_id=request_id, target_worker_id=target_worker_id)
        return (await self._call(address, "HandOff", request)).generated_tokens

    async def _call(self, address: str, method: str, request):
        stub = worker_pb2_grpc.WorkerStub(self.channels.get(address))
        try:
            return await getattr(stub, method)(request, timeout=self.deadline_s)
        except aio.AioRpcError as error:
            raise error_from_status(error, f"worker at {address} {method}") from error
