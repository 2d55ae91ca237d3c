"""The catalog's etcd calls on a blocking gRPC channel: transactions and reads from the calling
thread, and the watch on a thread of the catalog's own, which takes each response from gRPC's core
itself.

Every registration is a transaction, and every replica's watch delivers every registration.
Through aetcd's asyncio client, on an event loop of the catalog's own, each commit took a hop to
that loop and one back, and each watch response a hop from gRPC's asyncio poller thread to it.
Worse, gRPC's poller wakes every event loop its calls were made on for each completion of any
of them: the catalog's loop woke for every message of the store's own upload streams too. That
loop's thread took about as much of a replica's CPU as its event loop serving the uploads
(py-spy, issue 48). A blocking call waits in gRPC's core on the thread that commits, and the
watch's thread takes each response as it comes.

Transactions are given as etcd's messages (:mod:`.etcd_ops`) or aetcd's ``transactions``
objects (compares, ``Put``, ``Get``, ``Delete``), and answered as aetcd's ``Client.transaction``
answers: ``(succeeded, responses)``, a range's response as ``[(value, rtypes.Get)]``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import grpc.experimental
from aetcd import rpc, rtypes, transactions

from services.runtime.etcd import prefix_follower
from services.runtime.etcd.membership import EtcdUnreachable, MembershipConfig, channel_options
from services.runtime.etcd.prefix_follower import prefix_end
from services.runtime.security.tls import sync_channel

Txn = tuple[Sequence[Any], Sequence[Any], Sequence[Any]]
"""``(compare, success, failure)``, as aetcd's ``Client.transaction`` takes them."""


def txn_request(compare: Sequence[Any], success: Sequence[Any], failure: Sequence[Any]) -> Any:
    """The ``TxnRequest`` of one transaction (its checks and operations given as etcd's messages,
    :mod:`.etcd_ops`, or as aetcd's objects)."""
    return rpc.TxnRequest(
        compare=[c if type(c) is _COMPARE else c.build_message() for c in compare],
        success=_ops(success),
        failure=_ops(failure),
    )


_WATCH_METHOD = "/etcdserverpb.Watch/Watch"
_SINGLE_THREADED_UNARY_STREAM = grpc.experimental.ChannelOptions.SingleThreadedUnaryStream
_COMPARE, _REQUEST_OP = type(rpc.Compare()), type(rpc.RequestOp())


def _ops(ops: Sequence[Any]) -> list[Any]:
    out = []
    for op in ops:
        if type(op) is _REQUEST_OP:
            out.append(op)
        elif isinstance(op, transactions.Put):
            lease = op.lease if isinstance(op.lease, int) or op.lease is None else op.lease.id
            put = rpc.PutRequest(key=op.key, value=op.value, lease=lease or 0, prev_kv=op.prev_kv)
            out.append(rpc.RequestOp(request_put=put))
        elif isinstance(op, transactions.Get):
            out.append(
                rpc.RequestOp(request_range=rpc.RangeRequest(key=op.key, range_end=op.range_end or b""))
            )
        elif isinstance(op, transactions.Delete):
            delete = rpc.DeleteRangeRequest(key=op.key, range_end=op.range_end or b"", prev_kv=op.prev_kv)
            out.append(rpc.RequestOp(request_delete_range=delete))
        else:
            raise TypeError(f"not a catalog transaction's operation: {op!r}")
    return out


def txn_outcome(reply: Any) -> tuple[bool, list[Any]]:
    """``(succeeded, responses)`` of a ``TxnResponse``, as aetcd gives them."""
    responses: list[Any] = []
    for response in reply.responses:
        if response.WhichOneof("response") == "response_range":
            responses.append([(kv.value, rtypes.Get(reply.header, kv)) for kv in response.response_range.kvs])
        else:
            responses.append(response)
    return reply.succeeded, responses


class BlockingEtcd:
    """Calls on one blocking channel to one of the configured endpoints; when etcd does not
    answer a call, the channel is dropped and the next call dials the next endpoint."""

    def __init__(self, config: MembershipConfig):
        self._config = config
        self._endpoints = [f"{host}:{port}" for host, port in config.endpoints()]
        self._index = 0
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self._timeout = config.call_timeout_s
        self._watches: set[Any] = set()
        """The watch calls open now (:meth:`close` cancels them)."""
        self._closed = False
        """Set by :meth:`close`: a watch call made after it is cancelled at once."""

    def one(self, compare: Sequence[Any], success: Sequence[Any], failure: Sequence[Any], what: str):
        """One transaction: ``(succeeded, responses)``; :class:`EtcdUnreachable` (naming ``what``
        and the cause) when etcd does not answer."""
        stub, channel, endpoint = self._current()
        try:
            return txn_outcome(stub.Txn(txn_request(compare, success, failure), timeout=self._timeout))
        except grpc.RpcError as error:
            raise self._failed(channel, endpoint, error, what) from None

    def at_once(self, txns: Sequence[Txn], what: str) -> list[tuple[bool, list[Any]] | EtcdUnreachable]:
        """Send ``txns`` at once (etcd may commit them in one proposal) and wait for every
        answer: each one's ``(succeeded, responses)``, or :class:`EtcdUnreachable`."""
        stub, channel, endpoint = self._current()
        calls = [stub.Txn.future(txn_request(*txn), timeout=self._timeout) for txn in txns]
        outcomes: list[tuple[bool, list[Any]] | EtcdUnreachable] = []
        for call in calls:
            try:
                outcomes.append(txn_outcome(call.result()))
            except grpc.RpcError as error:
                outcomes.append(self._failed(channel, endpoint, error, what))
        return outcomes

    @property
    def endpoint(self) -> str:
        """The endpoint the next call goes to."""
        return self._endpoints[self._index]

    def get(self, key: bytes, what: str) -> Any:
        """The key-value at ``key`` (an etcd ``KeyValue``), None when there is none."""
        reply = self.range_page(key, b"", 0, 0, what)
        return reply.kvs[0] if reply.kvs else None

    def list_prefix(self, prefix: str, what: str) -> tuple[int, list[Any]]:
        """Every key-value under ``prefix``, read at one revision a page at a time (a single
        reply of 10,000 catalog rows is over gRPC's 4 MiB); that revision."""
        start, end, revision, kvs = prefix.encode(), prefix_end(prefix), 0, []
        while True:
            reply = self.range_page(start, end, prefix_follower.LIST_PAGE_ROWS, revision, what)
            revision = revision or reply.header.revision
            kvs += reply.kvs
            if not reply.more:
                return revision, kvs
            start = reply.kvs[-1].key + b"\0"

    def range_page(self, key: bytes, range_end: bytes, limit: int, revision: int, what: str) -> Any:
        """One ``Range`` call (at ``revision``, 0: the newest), its ``RangeResponse``."""
        stub, channel, endpoint = self._current()
        request = rpc.RangeRequest(key=key, range_end=range_end, limit=limit, revision=revision)
        try:
            return stub.Range(request, timeout=self._timeout)
        except grpc.RpcError as error:
            raise self._failed(channel, endpoint, error, what) from None

    def watch(self, key: bytes, range_end: bytes, start_revision: int, what: str) -> Iterator[Any]:
        """The ``WatchResponse`` s of every change of ``[key, range_end)`` from ``start_revision``
        on. It ends only by raising :class:`EtcdUnreachable` (etcd unreachable, the watch
        cancelled or its revision compacted away), or when :meth:`close` cancels it."""
        _, channel, endpoint = self._current()
        create = rpc.WatchCreateRequest(key=key, range_end=range_end, start_revision=start_revision)
        # Called as a unary-stream call: one request, then etcd's responses, which this thread
        # takes from gRPC's core itself (the channel's single-threaded unary-stream option). As a
        # bidirectional stream, each response went through gRPC's channel thread before this
        # one, and a thread of its own held the request stream open. etcd keeps a watch whose
        # client half-closed its stream (its grpc-gateway does so, etcd 3.1 on).
        call = channel.unary_stream(
            _WATCH_METHOD,
            request_serializer=rpc.WatchRequest.SerializeToString,
            response_deserializer=rpc.WatchResponse.FromString,
        )(rpc.WatchRequest(create_request=create))
        with self._lock:
            self._watches.add(call)
            if self._closed:  # close() ran while this call was being made: it never saw it
                call.cancel()
        try:
            for response in call:
                if response.canceled or response.compact_revision:
                    reason = response.cancel_reason or f"compacted at revision {response.compact_revision}"
                    raise EtcdUnreachable(what, f"etcd at {endpoint} ended the watch ({reason})")
                yield response
            raise EtcdUnreachable(what, f"etcd at {endpoint} ended the watch")
        except grpc.RpcError as error:
            raise self._failed(channel, endpoint, error, what) from None
        finally:
            call.cancel()
            with self._lock:
                self._watches.discard(call)

    def _failed(
        self, channel: grpc.Channel, endpoint: str, error: grpc.RpcError, what: str
    ) -> EtcdUnreachable:
        with self._lock:
            if self._channel is channel:  # else another call's failure dropped it already
                self._close()
                self._index = (self._index + 1) % len(self._endpoints)
        return EtcdUnreachable(what, f"etcd at {endpoint} unreachable ({_describe(error)})")

    def _current(self) -> tuple[Any, grpc.Channel, str]:
        with self._lock:
            endpoint = self._endpoints[self._index]
            if self._channel is None:
                options = [*channel_options(self._config).items(), (_SINGLE_THREADED_UNARY_STREAM, 1)]
                self._channel = sync_channel(endpoint, self._config.tls, options)
                self._stub = rpc.KVStub(self._channel)
            return self._stub, self._channel, endpoint

    def _close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel, self._stub = None, None

    def close(self) -> None:
        """Cancel the open watches and close the channel."""
        with self._lock:
            self._closed = True
            for call in self._watches:
                call.cancel()
            self._close()


def _describe(error: grpc.RpcError) -> str:
    code = error.code() if isinstance(error, grpc.Call) else None
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timed out"
    details = error.details() if isinstance(error, grpc.Call) else str(error)
    return f"{code.name if code else type(error).__name__}: {details}"
