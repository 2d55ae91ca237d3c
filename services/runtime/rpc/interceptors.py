"""The one place where domain errors become gRPC status codes, and where request ids are set.

Every service installs :class:`ServiceInterceptor`. It wraps each RPC handler so that
- the caller's ``x-request-id`` (or a new one) is bound to the logging context and echoed back
  in trailing metadata;
- a :class:`~services.runtime.errors.DomainError` aborts the RPC with its status code and
  message (cut to :data:`MAX_STATUS_MESSAGE_BYTES`), and anything unexpected becomes
  ``INTERNAL`` with the request id to find it in logs;
- a handler ended by a cancellation its caller did not ask for (a call of its own on a channel
  closed under it) ends ``UNAVAILABLE``, so the caller retries instead of waiting for its deadline;
- a request (or a message of a request stream) whose bytes do not parse ends
  ``INVALID_ARGUMENT``, not grpc's ``UNKNOWN``;
- a request stream refused before its end is read on (up to :data:`DRAIN_BYTES`, dropped) before
  the answer goes, so that the caller's pending writes do not turn its status into ``INTERNAL``;
- each RPC is counted and timed in the service's Prometheus metrics;
- the caller's verified mesh identity (mutual TLS) is bound to
  :data:`~services.runtime.security.tls.peer_identity_var` for the servicer (None over plaintext);
- with TLS on, the call is authorized by that identity (on the gateway's public port: as a
  tenant's) against the one table (services.runtime.security.authorization) before the servicer
  sees it: a caller outside the method's row ends ``PERMISSION_DENIED``, and so does one calling a
  method this server does not serve when the table would refuse it that method (a tenant asking
  the gateway for ``Scheduler/ClusterView`` learns why in one line, not grpc's "Method not found").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from services.runtime.errors import (
    DomainError,
    InvalidArgument,
    ResourceExhausted,
    StaleLeaderTerm,
    Unavailable,
)
from services.runtime.logs import request_id_var
from services.runtime.metrics import ServiceMetrics
from services.runtime.security.authorization import authorize
from services.runtime.security.identity import MeshIdentity
from services.runtime.security.tls import peer_identity, peer_identity_var

log = logging.getLogger("loramesh.rpc")

REQUEST_ID_HEADER = "x-request-id"
RETRY_AFTER_HEADER = "retry-after-s"
LEADER_TERM_HEADER = "leader-term"
"""On a :class:`StaleLeaderTerm` refusal: the newest leader term the callee has taken."""
MAX_STATUS_MESSAGE_BYTES = 1024
"""A status message is cut to this many UTF-8 bytes. It travels percent-encoded in the trailing
metadata, which a client refuses past 8 KiB (grpc's default): a message that echoes a long input
(an adapter name of megabytes) would otherwise reach the caller as ``RESOURCE_EXHAUSTED``
("metadata size exceeds soft limit") instead of its own status."""


def status_code_for(error: DomainError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, error.code_name, grpc.StatusCode.UNKNOWN)


_STATUS_ERRORS = {getattr(grpc.StatusCode, cls.code_name): cls for cls in DomainError.__subclasses__()}
"""A status another service's domain raised on purpose -> its error class."""


def error_from_status(error: grpc.RpcError, message: str) -> DomainError:
    """What another service's status means here: the domain error it raised (``NOT_FOUND`` ->
    ``NotFound``...), or ``Unavailable`` when it could not be reached, timed out or failed; a
    refusal naming a newer leader term (:data:`LEADER_TERM_HEADER`) is :class:`StaleLeaderTerm`."""
    text = f"{message}: {error.details() or error.code().name}"
    trailing = dict(error.trailing_metadata() or ()) if hasattr(error, "trailing_metadata") else {}
    term = str(trailing.get(LEADER_TERM_HEADER, ""))
    if error.code() == grpc.StatusCode.FAILED_PRECONDITION and term.isdigit():
        return StaleLeaderTerm(text, int(term))
    return _STATUS_ERRORS.get(error.code(), Unavailable)(text)


class _RpcScope:
    """Bookkeeping for one RPC: request id, timing, error translation."""

    def __init__(self, method: str, metadata, metrics: ServiceMetrics | None):
        headers = dict(metadata or ())
        self.request_id = str(headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex[:16])
        self.method = method.rsplit("/", 1)[-1]
        self.metrics = metrics
        self.started = time.perf_counter()
        self.code = "OK"
        self._token = None
        self._peer_token = None

    def enter(self, context: aio.ServicerContext) -> MeshIdentity | None:
        """Bind the request id and the caller's identity; the identity."""
        identity = peer_identity(context)
        self._token = request_id_var.set(self.request_id)
        self._peer_token = peer_identity_var.set(identity)
        context.set_trailing_metadata(((REQUEST_ID_HEADER, self.request_id),))
        return identity

    async def fail(self, error: BaseException, context: aio.ServicerContext) -> None:
        """Abort the RPC with the status that ``error`` stands for (always raises)."""
        if isinstance(error, DomainError):
            code = status_code_for(error)
            self.code = code.name
            trailing = [(REQUEST_ID_HEADER, self.request_id)]
            if isinstance(error, ResourceExhausted) and error.retry_after_s is not None:
                trailing.append((RETRY_AFTER_HEADER, f"{error.retry_after_s:.3f}"))
            if isinstance(error, StaleLeaderTerm):
                trailing.append((LEADER_TERM_HEADER, str(error.current_term)))
            context.set_trailing_metadata(tuple(trailing))
            log.info("%s -> %s: %s", self.method, code.name, error.message)
            await context.abort(code, bounded(error.message))
        if isinstance(error, aio.AioRpcError):
            # A call to another service failed with a status of its own (a scheduler's
            # RESOURCE_EXHAUSTED, a worker's INVALID_ARGUMENT): pass it on as it is.
            code = error.code()
            self.code = code.name
            passed = [(k, v) for k, v in (error.trailing_metadata() or ()) if k == RETRY_AFTER_HEADER]
            context.set_trailing_metadata(((REQUEST_ID_HEADER, self.request_id), *passed))
            log.info("%s -> %s from upstream: %s", self.method, code.name, error.details())
            await context.abort(code, bounded(error.details() or code.name))
        if isinstance(error, NotImplementedError):
            # A generated servicer's default body: a method of the proto this server lacks
            # (grpc's asyncio health servicer has no List).
            self.code = "UNIMPLEMENTED"
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{self.method} is not implemented here")
        self.code = "INTERNAL"
        log.exception("%s failed unexpectedly", self.method)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error (request id {self.request_id})")

    def exit(self, context: aio.ServicerContext, error: BaseException | None = None) -> None:
        # A caller that goes away cancels the handler's task: the handler sees CancelledError,
        # and context.cancelled() is not yet true when it unwinds.
        if self.code == "OK" and (isinstance(error, asyncio.CancelledError) or context.cancelled()):
            self.code = "CANCELLED"
        if self.metrics is not None:
            self.metrics.observe_rpc(self.method, self.code, time.perf_counter() - self.started)
        if self._token is not None:
            # A stream its caller abandoned is closed by asyncio in another context, where the
            # token does not apply (ValueError); that context's request id is not ours to reset.
            with contextlib.suppress(ValueError):
                request_id_var.reset(self._token)
            with contextlib.suppress(ValueError):
                peer_identity_var.reset(self._peer_token)


def bounded(message: str) -> str:
    """``message`` within :data:`MAX_STATUS_MESSAGE_BYTES`, marked when cut."""
    encoded = message.encode("utf-8", "replace")
    if len(encoded) <= MAX_STATUS_MESSAGE_BYTES:
        return message
    return encoded[: MAX_STATUS_MESSAGE_BYTES - 3].decode("utf-8", "ignore") + "..."


DRAIN_BYTES = 64 * 2**20
"""After refusing a request stream (an upload) before its end, the server still reads (and drops)
up to this much more of it before it answers. A client still sending when the answer comes gets
grpc's ``INTERNAL`` "Internal error from Core" for its failed write instead of the answer (a
worker refused ``RegisterAdapter`` by the authorization table: 2 to 5 calls in 300 of 1.8 MB)."""


class _Undecodable:
    """A request whose bytes are no message of the method's type (what the deserializer said)."""

    def __init__(self, error: Exception, size: int):
        self.error = error
        self.size = size


def _message_bytes(message) -> int:
    """A received message's size on the wire: a protobuf message's, an undecodable one's, or a
    service reader's message's ``wire`` (``mesh_api.upload_wire``)."""
    if isinstance(message, _Undecodable):
        return message.size
    wire = getattr(message, "wire", None)
    return len(wire) if wire is not None else message.ByteSize()


async def _drain(requests) -> None:
    """Read what is left of a refused request stream, up to :data:`DRAIN_BYTES`."""
    dropped = 0
    with contextlib.suppress(Exception):  # the stream may be broken already: the answer still goes
        async for message in requests:
            dropped += _message_bytes(message)
            if dropped > DRAIN_BYTES:
                break


def _lenient(deserializer):
    """``deserializer``, returning :class:`_Undecodable` instead of raising: grpc would answer a
    request it cannot parse ``UNKNOWN``; the wrapper below answers ``INVALID_ARGUMENT``."""
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except DecodeError as error:
            return _Undecodable(error, len(data))

    return deserialize


def _decoded(request):
    if isinstance(request, _Undecodable):
        raise InvalidArgument(f"the request is not a valid message of its type: {request.error}")
    return request


async def _decoded_stream(requests):
    async for request in requests:
        yield _decoded(request)


def _requests(request_or_iterator):
    """The request, or the stream of them, refused INVALID_ARGUMENT where one does not parse."""
    if hasattr(request_or_iterator, "__aiter__"):
        return _decoded_stream(request_or_iterator)
    return _decoded(request_or_iterator)


def _caller_cancelled(context) -> bool:
    """Whether the handler's task was cancelled from outside: its caller went away or the server
    is stopping. Otherwise a ``CancelledError`` came from within: grpc ends the calls of a channel
    closed under them (an etcd client reset while a call was in flight) with one, and a handler
    that ended with it would leave its caller no status at all, waiting for its deadline."""
    task = asyncio.current_task()
    return context.cancelled() or (task is not None and task.cancelling() > 0)


def _is_abort(error: BaseException) -> bool:
    # context.abort() raises this; it must pass through untouched.
    return isinstance(error, aio.AbortError)


@contextlib.asynccontextmanager
async def _serving(
    method: str,
    metadata,
    metrics: ServiceMetrics | None,
    enforce: bool,
    public: bool,
    context,
    refused_stream=None,
):
    """One RPC's handling around its handler: the request id and the caller's identity bound,
    the call authorized (with ``enforce``; as a tenant's on a ``public`` port), an error turned
    into its status, the RPC counted. ``refused_stream``: the request stream, read on
    (:func:`_drain`) when the call is refused."""
    scope = _RpcScope(method, metadata, metrics)
    identity = scope.enter(context)
    ended: BaseException | None = None
    try:
        if enforce:
            authorize(method, identity, public=public)
        yield
    except BaseException as error:
        ended = error
        if isinstance(error, asyncio.CancelledError) and not _caller_cancelled(context):
            error = Unavailable(
                f"{scope.method} was cut short by a call of its own that was cancelled; retry"
            )
        elif _is_abort(error) or not isinstance(error, Exception):
            raise
        if refused_stream is not None:
            await _drain(refused_stream)
        await scope.fail(error, context)
    finally:
        scope.exit(context, ended)


def _unserved(method: str, metadata, public: bool) -> grpc.RpcMethodHandler:
    """A method this server has no handler for, under TLS: refused as the table refuses its caller
    (PERMISSION_DENIED), else UNIMPLEMENTED. Not counted in the metrics: its name is the caller's."""

    async def refuse(request: bytes, context) -> bytes:
        async with _serving(method, metadata, None, True, public, context):
            raise NotImplementedError(method)

    return grpc.unary_unary_rpc_method_handler(refuse)


class ServiceInterceptor(aio.ServerInterceptor):
    def __init__(
        self, metrics: ServiceMetrics | None = None, enforce_authorization: bool = False, public: bool = False
    ):
        """``enforce_authorization``: check every call against the authorization table (the
        servers turn it on exactly when they run with TLS; off, every caller is served).
        ``public``: this is the gateway's public port, which reads no client certificate: every
        caller is a tenant."""
        self._metrics = metrics
        self._enforce = enforce_authorization
        self._public = public

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method, metadata, metrics = details.method, details.invocation_metadata, self._metrics
        enforce, public = self._enforce, self._public
        if handler is None:
            return _unserved(method, metadata, public) if enforce else None

        def unary_response(behavior, request_streaming: bool):
            async def wrapped(request_or_iterator, context):
                refused_stream = request_or_iterator if request_streaming else None
                async with _serving(method, metadata, metrics, enforce, public, context, refused_stream):
                    return await behavior(_requests(request_or_iterator), context)

            return wrapped

        def stream_response(behavior):
            async def wrapped(request_or_iterator, context):
                async with _serving(method, metadata, metrics, enforce, public, context):
                    result = behavior(_requests(request_or_iterator), context)
                    if hasattr(result, "__aiter__"):
                        async for response in result:
                            yield response
                    else:  # a handler that writes with context.write() (grpc's health Watch)
                        await result

            return wrapped

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                unary_response(handler.unary_unary, request_streaming=False),
                _lenient(handler.request_deserializer),
                handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                unary_response(handler.stream_unary, request_streaming=True),
                _lenient(handler.request_deserializer),
                handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                stream_response(handler.unary_stream),
                _lenient(handler.request_deserializer),
                handler.response_serializer,
            )
        return grpc.stream_stream_rpc_method_handler(
            stream_response(handler.stream_stream),
            _lenient(handler.request_deserializer),
            handler.response_serializer,
        )
