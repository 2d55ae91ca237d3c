"""A :class:`CreditorTransport` over gRPC: a creditor's lending API (``Worker/AllocateBlocks`` ...)
as the debtor's engine thread calls it.

Synchronous on purpose: the engine thread is not an event loop, and a step cannot go on before
its remote attention is back. Statuses come back as the domain errors the creditor raised
(``RESOURCE_EXHAUSTED`` → ``ResourceExhausted``...). A creditor that cannot be reached, misses
the deadline or fails internally is ``Unavailable``: the debtor treats it as dead and recomputes
what it held.

Every message's serialized bytes are counted into a :class:`DistKvMeter` as gRPC sends and
receives them (the serializers count), so the figures are the wire payloads, measured without
serializing anything twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import torch
from google.protobuf.message import Message

from mesh_api.v1 import worker_pb2
from services.gpu_worker.lending_proto import (
    layout_from_proto,
    layout_to_proto,
    partials_from_proto,
    segment_to_proto,
    tensor_from_proto,
    tensor_to_proto,
)
from services.gpu_worker.memory.distkv_meter import DistKvMeter
from services.gpu_worker.memory.kv_block_allocator import AttendSegment
from services.gpu_worker.memory.unified_pool import PoolLayout
from services.gpu_worker.model.dist_attention import PartialAttention
from services.runtime.errors import (
    AlreadyExists,
    DataLoss,
    DomainError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from services.runtime.server import MAX_MESSAGE_BYTES
from services.runtime.tls import NO_TLS, TLSConfig, sync_channel

_ERRORS: dict[grpc.StatusCode, type[DomainError]] = {
    getattr(grpc.StatusCode, cls.code_name): cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        Unauthenticated,
        ResourceExhausted,
        FailedPrecondition,
        DataLoss,
    )
}
"""Statuses the creditor's domain raised on purpose; every other status is ``Unavailable``."""

_WORKER = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
_LENDING_REPLIES: dict[str, type[Message]] = {
    "AllocateBlocks": worker_pb2.AllocateBlocksResponse,
    "WriteKv": worker_pb2.WriteKvResponse,
    "FreeBlocks": worker_pb2.FreeBlocksResponse,
    "AttendRemote": worker_pb2.AttendRemoteResponse,
    "ReadBlocks": worker_pb2.ReadBlocksResponse,
}
"""The lending RPCs, by method name, with their reply types."""


class GrpcCreditorTransport:
    """The lending API of the creditor at ``address``, for a debtor whose blocks are ``layout``."""

    def __init__(
        self,
        creditor: str,
        address: str,
        layout: PoolLayout,
        meter: DistKvMeter | None = None,
        deadline_s: float = 60.0,
        tls: TLSConfig = NO_TLS,
    ):
        """``meter``: where the bytes sent and received are counted (the debtor's; None: one of
        its own). ``deadline_s`` bounds each call: a creditor that hangs is treated as dead, not
        waited on. ``tls``: the worker's mutual TLS settings."""
        self.creditor = creditor
        self.address = address
        self.layout = layout
        self.meter = meter if meter is not None else DistKvMeter()
        self.deadline_s = deadline_s
        self._channel = sync_channel(
            address,
            tls,
            [
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        self._calls = {name: self._counted_call(name, reply) for name, reply in _LENDING_REPLIES.items()}

    def _counted_call(self, name: str, reply: type[Message]) -> grpc.UnaryUnaryMultiCallable:
        def serialize(request: Message) -> bytes:
            data = request.SerializeToString()
            self.meter.add_bytes(sent=len(data))
            return data

        def deserialize(data: bytes) -> Message:
            self.meter.add_bytes(received=len(data))
            return reply.FromString(data)

        return self._channel.unary_unary(
            f"/{_WORKER.full_name}/{name}", request_serializer=serialize, response_deserializer=deserialize
        )

    def close(self) -> None:
        self._channel.close()

    def allocate(self, debtor: str, count: int) -> list[int]:
        reply = self._call(
            self._calls["AllocateBlocks"],
            worker_pb2.AllocateBlocksRequest(debtor=debtor, count=count, layout=layout_to_proto(self.layout)),
        )
        lender = layout_from_proto(reply.layout)
        if not self.layout.same_blocks(lender):
            raise FailedPrecondition(f"creditor {self.creditor} lends blocks shaped {lender}, not like ours")
        return list(reply.block_ids)

    def write(
        self,
        debtor: str,
        layer: int,
        block_ids: Sequence[int],
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        self._call(
            self._calls["WriteKv"],
            worker_pb2.WriteKvRequest(
                debtor=debtor,
                layer=layer,
                block_ids=list(block_ids),
                slots=tensor_to_proto(slots.to(torch.int64)),
                keys=tensor_to_proto(keys),
                values=tensor_to_proto(values),
            ),
        )

    def free(self, debtor: str, block_ids: Sequence[int]) -> None:
        self._call(
            self._calls["FreeBlocks"], worker_pb2.FreeBlocksRequest(debtor=debtor, block_ids=list(block_ids))
        )

    def attend(
        self, debtor: str, layer: int, segments: Sequence[AttendSegment[int]]
    ) -> list[PartialAttention]:
        reply = self._call(
            self._calls["AttendRemote"],
            worker_pb2.AttendRemoteRequest(
                debtor=debtor, layer=layer, segments=[segment_to_proto(s) for s in segments]
            ),
        )
        if len(reply.partials) != len(segments):
            raise Unavailable(
                f"creditor {self.creditor} answered {len(reply.partials)} partials for {len(segments)} segments"
            )
        device = segments[0].queries.device if segments else "cpu"
        return partials_from_proto(reply, device)

    def read(self, debtor: str, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        reply = self._call(
            self._calls["ReadBlocks"], worker_pb2.ReadBlocksRequest(debtor=debtor, block_ids=list(block_ids))
        )
        return tensor_from_proto(reply.keys, "keys"), tensor_from_proto(reply.values, "values")

    def _call(self, method, request):
        try:
            return method(request, timeout=self.deadline_s)
        except grpc.RpcError as error:
            code = error.code()
            cls = _ERRORS.get(code)
            message = f"creditor {self.creditor} ({self.address}): {error.details() or code.name}"
            if cls is None:
                raise Unavailable(message) from error
            raise cls(message) from error
