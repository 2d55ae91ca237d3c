"""The gpu_workers' DGFM RPCs (``Worker/RecallBlocks``, ``StageOutBlocks``, ``StageInBlocks``) as
the kv_manager's :class:`~services.kv_manager.dgfm_execution.RecallWorkers`.

A worker's status comes back as the domain error it raised (``RESOURCE_EXHAUSTED`` ->
``ResourceExhausted``...); a worker that cannot be reached, misses the deadline or fails
internally is ``Unavailable``.

Each call is a leader's write, fenced by term (issue 49): just before it is sent, etcd confirms
this kv_manager still holds the leader key at its term, and the call carries that term. A worker
that has taken a newer term refuses it (``StaleLeaderTerm``), and this kv_manager steps down.

The channels ping as every service channel does (:mod:`services.runtime.rpc.keepalive`): a
recall to a worker whose node vanished (no reset ever comes) fails UNAVAILABLE when its
connection is given up, instead of holding the DGFM round to the call's deadline, and the next
recall dials afresh instead of queueing on a dead connection.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from grpc import aio

from mesh_api.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from services.runtime.errors import NotFound, StaleLeaderTerm, Unavailable
from services.runtime.rpc import keepalive
from services.runtime.rpc.interceptors import error_from_status
from services.runtime.security.tls import NO_TLS, TLSConfig, aio_channel


class LeaderTenure(Protocol):
    """This kv_manager's leadership as its writes check it
    (:class:`~services.runtime.etcd.leader_election.LeaderElection`)."""

    instance_id: str

    async def confirm(self) -> int:
        """Its term if etcd still shows it leading under it, else 0 (and it has stepped down)."""
        ...

    def step_down(self, term: int, why: str) -> None:
        """A worker refused a write of ``term``: stop leading under it."""
        ...


class GrpcRecallWorkers:
    """The workers at ``addresses`` (``{worker id: host:port}``, from the ledger), written to
    under ``tenure``."""

    def __init__(
        self,
        addresses: Mapping[str, str],
        tenure: LeaderTenure,
        deadline_s: float,
        tls: TLSConfig = NO_TLS,
    ):
        """``deadline_s`` bounds each call: a recall waits for the worker's current step."""
        self.addresses = dict(addresses)
        self.tenure = tenure
        self.deadline_s = deadline_s
        self.tls = tls
        self._channels: dict[str, aio.Channel] = {}

    async def recall(self, owner_id: str, holder_id: str, blocks: int) -> int:
        request = worker_pb2.RecallBlocksRequest(holder=holder_id, blocks=blocks)
        return (await self._call(owner_id, "RecallBlocks", request)).blocks_moved

    async def stage_out(self, owner_id: str, holder_id: str, blocks: int) -> int:
        request = worker_pb2.StageOutBlocksRequest(holder=holder_id, blocks=blocks)
        return (await self._call(owner_id, "StageOutBlocks", request)).stage_id

    async def stage_in(self, owner_id: str, stage_id: int) -> int:
        request = worker_pb2.StageInBlocksRequest(stage_id=stage_id)
        return (await self._call(owner_id, "StageInBlocks", request)).blocks_home

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels = {}

    async def _call(self, worker_id: str, method: str, request):
        address = self.addresses.get(worker_id)
        if address is None:
            raise NotFound(f"worker {worker_id!r} is not in the ledger: it left before its recall")
        leader = self.tenure.instance_id
        term = await self.tenure.confirm()
        if not term:
            raise Unavailable(f"{method} to worker {worker_id} not sent: kv_manager {leader} no longer leads")
        request.leader.CopyFrom(types_pb2.LeaderTerm(term=term, leader_id=leader))
        if worker_id not in self._channels:
            self._channels[worker_id] = aio_channel(address, self.tls, keepalive.CHANNEL_OPTIONS)
        stub = worker_pb2_grpc.WorkerStub(self._channels[worker_id])
        try:
            return await getattr(stub, method)(request, timeout=self.deadline_s)
        except aio.AioRpcError as error:
            failure = error_from_status(error, f"worker {worker_id} ({address}) {method}")
            if isinstance(failure, StaleLeaderTerm):
                self.tenure.step_down(term, failure.message)
            raise failure from error
