"""The kv_manager (gManager) as the engine thread's :class:`CreditorDirectory`: synchronous
``SuggestCreditors`` and ``ReportRefusal`` calls.

The replicas' addresses are kept current by the worker service's etcd watch (``addresses``);
calls go to each in turn, because only the leader answers: a standby says ``UNAVAILABLE``.
"""

from __future__ import annotations

import logging

import grpc

from mesh_api.v1 import kv_manager_pb2, kv_manager_pb2_grpc
from services.gpu_worker.distkv.borrower import Candidate
from services.runtime.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from services.runtime.rpc import keepalive
from services.runtime.security.tls import NO_TLS, TLSConfig, sync_channel

log = logging.getLogger("loramesh.worker")


class KvManagerDirectory:
    """Creditor suggestions from the kv_manager replicas at ``addresses``."""

    def __init__(self, addresses: tuple[str, ...] = (), deadline_s: float = 10.0, tls: TLSConfig = NO_TLS):
        """``deadline_s`` bounds each call (a hung kv_manager means: no creditor now)."""
        self.addresses = addresses
        """Replaced whole by the etcd watch; read by the engine thread."""
        self.deadline_s = deadline_s
        self.tls = tls
        self._channels: dict[str, grpc.Channel] = {}

    def suggest(self, debtor: str, blocks: int) -> list[Candidate]:
        request = kv_manager_pb2.SuggestCreditorsRequest(debtor_id=debtor, blocks=blocks)
        reply = self._call_leader("SuggestCreditors", request)
        return [Candidate(c.worker_id, c.address, c.lendable_blocks) for c in reply.candidates]

    def report_refusal(self, debtor: str, creditor: str) -> None:
        request = kv_manager_pb2.ReportRefusalRequest(creditor_id=creditor, debtor_id=debtor)
        try:
            self._call_leader("ReportRefusal", request)
        except (Unavailable, ResourceExhausted, NotFound, InvalidArgument) as error:
            # Advice only: the next heartbeat corrects the ledger anyway.
            log.info("could not report %s's refusal: %s", creditor, error)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def _call_leader(self, method: str, request):
        addresses = self.addresses
        if not addresses:
            raise Unavailable("no kv_manager is registered: nobody to ask for creditors")
        last = ""
        for address in addresses:
            stub = kv_manager_pb2_grpc.KVManagerStub(self._channel(address))
            try:
                return getattr(stub, method)(request, timeout=self.deadline_s)
            except grpc.RpcError as error:
                code, last = error.code(), f"{address}: {error.details() or error.code().name}"
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise ResourceExhausted(last) from error
                if code == grpc.StatusCode.NOT_FOUND:  # it has no heartbeat of ours yet
                    raise NotFound(last) from error
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidArgument(last) from error
                if code == grpc.StatusCode.FAILED_PRECONDITION:  # more than the mesh ever lends
                    raise FailedPrecondition(last) from error
        raise Unavailable(f"no kv_manager leader answered (last: {last})")

    def _channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            # The service channels' keepalive and reconnect settings: a kv_manager back from an
            # outage is asked again within 5 s, not after gRPC's backoff of up to 2 minutes.
            self._channels[address] = sync_channel(address, self.tls, keepalive.CHANNEL_OPTIONS)
        return self._channels[address]
