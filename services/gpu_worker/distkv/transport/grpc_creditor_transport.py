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

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc
import torch
from google.protobuf.message import Message

from mesh_api.v1 import worker_pb2
from services.gpu_worker.attention.dist_attention import PartialAttention
from services.gpu_worker.attention.pool_view import PoolLayout
from services.gpu_worker.distkv.distkv_meter import DistKvMeter
from services.gpu_worker.distkv.kv_block_allocator import AttendCall, KvRows
from services.gpu_worker.distkv.remote_block_allocator import Pending, done
from services.gpu_worker.distkv.shared_creditor_pool import SharedCreditorPool
from services.gpu_worker.distkv.transport import tcp_lane
from services.gpu_worker.distkv.transport.lending_lane import ATTEND, WRITE, LaneClient
from services.gpu_worker.distkv.transport.lending_proto import (
    layout_from_proto,
    layout_to_proto,
    partials_from_proto,
    rows_to_proto,
    segment_to_proto,
    tensor_from_proto,
)
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
from services.runtime.rpc import keepalive
from services.runtime.rpc.server import MAX_MESSAGE_BYTES
from services.runtime.security.tls import NO_TLS, TLSConfig, sync_channel

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

log = logging.getLogger(__name__)

T = TypeVar("T")

_WORKER = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
_LENDING_REPLIES: dict[str, type[Message]] = {
    "AllocateBlocks": worker_pb2.AllocateBlocksResponse,
    "WriteKv": worker_pb2.WriteKvResponse,
    "FreeBlocks": worker_pb2.FreeBlocksResponse,
    "AttendRemote": worker_pb2.AttendRemoteResponse,
    "ReadBlocks": worker_pb2.ReadBlocksResponse,
    "OpenLendingLane": worker_pb2.OpenLendingLaneResponse,
}
"""The lending RPCs, by method name, with their reply types."""

LENDING_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    *keepalive.CHANNEL_OPTIONS,
)
"""Options of a debtor's channel to a creditor: the service channels' keepalives, so that a call
to a creditor that vanished (its node lost, a partition: no reset ever comes) fails within
``PING_EVERY_S + PING_TIMEOUT_S`` while it is open, not at the call's deadline, and the debtor
recomputes what that creditor held."""


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
        lane: str = "shared-memory",
        dtype: torch.dtype = torch.float32,
    ):
        """``meter``: where the bytes sent and received are counted (the debtor's; None: one of
        its own). ``deadline_s`` bounds each call: a creditor that hangs is treated as dead, not
        waited on. ``tls``: the worker's mutual TLS settings (the TCP lane's too). ``lane``: how
        to reach the creditor (``lane_modes.LANE_MODES``): its pool mapped when it shares one in
        ``dtype`` (our KV's), else its Unix socket (same host), else its TCP lane, else gRPC;
        "socket" starts at the Unix socket, "tcp" at the TCP lane; "off": always gRPC."""
        self.creditor = creditor
        self.address = address
        self.layout = layout
        self.meter = meter if meter is not None else DistKvMeter()
        self.deadline_s = deadline_s
        self.tls = tls
        self._channel = sync_channel(address, tls, LENDING_CHANNEL_OPTIONS)
        self._calls = {name: self._counted_call(name, reply) for name, reply in _LENDING_REPLIES.items()}
        self.dtype = dtype
        self._mode = lane
        self._lane: LaneClient | None = None
        self._lane_asked = lane == "off"
        self._shared: SharedCreditorPool | None = None
        self._releasing: set[grpc.Future] = set()
        """Releases in flight, held so that none is cancelled when collected."""

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
        self._shared = None  # unmapped once its last tensor goes
        if self._lane is not None:
            self._lane.close()
        self._channel.close()

    def _lane_of(self, debtor: str) -> LaneClient | None:
        """The creditor's lane for ``debtor``, opened at the first call that can take it; None
        where it has none (lanes off, or it could not be opened: gRPC then). A TCP lane that
        failed is opened anew at the next call: a reset connection or a healed partition does
        not leave a live creditor unreachable (the calls it failed were recomputed)."""
        if self._lane is not None and self._lane.remote and self._lane.broken:
            self._lane.close()
            self._lane, self._lane_asked = None, False
        if self._lane_asked:
            return self._lane
        self._lane_asked = True
        try:
            reply = self._call(
                self._calls["OpenLendingLane"], worker_pb2.OpenLendingLaneRequest(debtor=debtor)
            )
        except DomainError as no_lane:
            log.info("no lending lane to %s, using gRPC: %s", self.creditor, no_lane)
            # Unreachable now, maybe not at the next call; any other refusal stands.
            self._lane_asked = not isinstance(no_lane, Unavailable)
            return None
        if reply.path and self._mode != "tcp":
            try:
                self._lane = LaneClient.over_unix(
                    self.creditor, reply.path, reply.token, self.meter, _refusal, self.deadline_s
                )
                if self._mode == "shared-memory":
                    self._shared = self._lane.map_pool(self.dtype)
            except OSError as elsewhere:  # another network namespace: another pod or host
                log.info("%s's Unix lane cannot be reached: %s", self.creditor, elsewhere)
        if self._lane is None and reply.tcp_port:
            host = tcp_lane.split_host(self.address)
            try:
                connection = tcp_lane.connect(host, reply.tcp_port, self.tls, self.deadline_s)
                self._lane = LaneClient(self.creditor, connection, reply.token, self.meter, _refusal)
            except OSError as unreachable:  # a TLS failure is an OSError too
                # Worth an operator's look: a firewall or a NetworkPolicy closed to the port
                # costs every borrowing step ~1 ms per layer over gRPC instead.
                log.warning(
                    "%s's TCP lending lane at %s:%d cannot be reached, lending calls go over gRPC: %s",
                    self.creditor, host, reply.tcp_port, unreachable,
                )  # fmt: skip
        if self._lane is None:
            log.info("no lending lane to %s, using gRPC", self.creditor)
        return self._lane

    def allocate(self, debtor: str, count: int) -> list[int]:
        reply = self._call(
            self._calls["AllocateBlocks"],
            worker_pb2.AllocateBlocksRequest(debtor=debtor, count=count, layout=layout_to_proto(self.layout)),
        )
        lender = layout_from_proto(reply.layout)
        if not self.layout.same_blocks(lender):
            raise FailedPrecondition(f"creditor {self.creditor} lends blocks shaped {lender}, not like ours")
        block_ids = list(reply.block_ids)
        lane = self._lane_of(debtor)
        if self._shared is not None:
            self._shared.learn(block_ids, lane.pages(block_ids))
        return block_ids

    def write_async(self, debtor: str, layer: int, rows: KvRows[int]) -> Pending[None]:
        lane = self._lane_of(debtor)
        if self._shared is not None:
            lane.check_open()
            return done(lambda: self._shared.write(layer, rows))
        request = rows_to_proto(rows, worker_pb2.WriteKvRequest, debtor=debtor, layer=layer)
        if lane is not None:
            return lane.call(WRITE, request, lambda data: None)
        return self._call_async(self._calls["WriteKv"], request, lambda reply: None)

    def free(self, debtor: str, block_ids: Sequence[int]) -> None:
        if self._shared is not None:
            self._shared.forget(block_ids)
        self._call(
            self._calls["FreeBlocks"], worker_pb2.FreeBlocksRequest(debtor=debtor, block_ids=list(block_ids))
        )

    def attend(self, debtor: str, call: AttendCall[int]) -> Pending[list[PartialAttention]]:
        lane = self._lane_of(debtor)
        if self._shared is not None:
            lane.check_open()  # a dead creditor's blocks are recomputed, as over gRPC
            return done(lambda: self._shared.attend(call))
        segments = call.segments
        request = worker_pb2.AttendRemoteRequest(
            debtor=debtor, layer=call.layer, segments=[segment_to_proto(s) for s in segments]
        )
        if call.write is not None:
            request.write.CopyFrom(rows_to_proto(call.write))
        device = segments[0].queries.device if segments else "cpu"

        def partials(reply: worker_pb2.AttendRemoteResponse) -> list[PartialAttention]:
            if len(reply.partials) != len(segments):
                raise Unavailable(
                    f"creditor {self.creditor} answered {len(reply.partials)} partials for {len(segments)} segments"
                )
            return partials_from_proto(reply, device)

        if lane is not None:
            return lane.call(
                ATTEND, request, lambda data: partials(worker_pb2.AttendRemoteResponse.FromString(data))
            )
        return self._call_async(self._calls["AttendRemote"], request, partials)

    def release(self, debtor: str, block_ids: Sequence[int]) -> None:
        if self._shared is not None:
            self._shared.forget(block_ids)
        # Over gRPC whatever the lane: a lane that failed is what got these blocks declared lost.
        for block_id in block_ids:
            future = self._calls["FreeBlocks"].future(
                worker_pb2.FreeBlocksRequest(debtor=debtor, block_ids=[block_id]), timeout=self.deadline_s
            )
            self._releasing.add(future)
            future.add_done_callback(self._released(block_id))

    def _released(self, block_id: int) -> Callable[[grpc.Future], None]:
        def log_outcome(future: grpc.Future) -> None:
            self._releasing.discard(future)
            error = future.exception()
            if error is None:
                log.info("released block %d on %s, which lived after all", block_id, self.creditor)
            else:
                log.debug("block %d on %s not released: %s", block_id, self.creditor, error.details())

        return log_outcome

    def read(self, debtor: str, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        reply = self._call(
            self._calls["ReadBlocks"], worker_pb2.ReadBlocksRequest(debtor=debtor, block_ids=list(block_ids))
        )
        return tensor_from_proto(reply.keys, "keys"), tensor_from_proto(reply.values, "values")

    def _call(self, method, request):
        try:
            return method(request, timeout=self.deadline_s)
        except grpc.RpcError as error:
            raise self._domain_error(error) from error

    def _call_async(self, method, request, parse: Callable[[Message], T]) -> Pending[T]:
        """``method(request)`` sent now; its pending answer is ``parse(reply)``."""
        future = method.future(request, timeout=self.deadline_s)
        return _GrpcAnswer(self, future, parse)

    def _domain_error(self, error: grpc.RpcError) -> DomainError:
        code = error.code()
        cls = _ERRORS.get(code)
        message = f"creditor {self.creditor} ({self.address}): {error.details() or code.name}"
        return Unavailable(message) if cls is None else cls(message)


def _refusal(code_name: str, message: str) -> DomainError:
    """The domain error of a lane's refusal named ``code_name``, as the RPC's status maps."""
    cls = {cls.code_name: cls for cls in _ERRORS.values()}.get(code_name, Unavailable)
    return cls(message)


class _GrpcAnswer:
    """A call in flight: ``result()`` waits for its reply, statuses mapped as for a blocking call."""

    def __init__(self, transport: GrpcCreditorTransport, future: grpc.Future, parse: Callable[[Message], T]):
        self.transport = transport
        self.future = future
        self.parse = parse

    def result(self):
        try:
            reply = self.future.result()
        except grpc.RpcError as error:
            raise self.transport._domain_error(error) from error
        return self.parse(reply)
