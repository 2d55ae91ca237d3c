"""The interceptor's RPC metrics record how a streamed RPC really ended, on a real loopback server."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc import aio
from support.polling import HANG_GUARD_S, poll_until

from services.runtime.errors import InvalidArgument
from services.runtime.metrics import ServiceMetrics
from services.runtime.rpc.interceptors import ServiceInterceptor

SERVICE = "test.Streams"


async def _forever(request: bytes, context):
    """One message, then nothing until the caller goes away (only the client can end it)."""
    yield b"first"
    await asyncio.Event().wait()


async def _refuse(request: bytes, context):
    raise InvalidArgument("refused on purpose")
    yield b""  # pragma: no cover - makes this a generator


async def _two(request: bytes, context):
    yield b"a"
    yield b"b"


def _handler(behavior):
    return grpc.unary_stream_rpc_method_handler(behavior, lambda b: b, lambda b: b)


@pytest.fixture
async def served():
    metrics = ServiceMetrics("test")
    server = aio.server(interceptors=[ServiceInterceptor(metrics)])
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                SERVICE, {"Forever": _handler(_forever), "Refuse": _handler(_refuse), "Two": _handler(_two)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield metrics, channel
    finally:
        await channel.close()
        await server.stop(None)


def _count(metrics: ServiceMetrics, method: str, code: str) -> float:
    value = metrics.registry.get_sample_value(
        "loramesh_rpc_total", {"service": "test", "method": method, "code": code}
    )
    return value or 0.0


def _call(channel: aio.Channel, method: str):
    return channel.unary_stream(f"/{SERVICE}/{method}", lambda b: b, lambda b: b)(b"")


async def test_a_stream_the_client_cancels_is_recorded_as_cancelled_not_ok(served):
    metrics, channel = served
    call = _call(channel, "Forever")
    assert await call.read() == b"first"  # the handler is running
    call.cancel()

    async def counts():
        return _count(metrics, "Forever", "CANCELLED"), _count(metrics, "Forever", "OK")

    assert await poll_until(counts, lambda c: c[0] == 1, "the cancelled stream recorded") == (1, 0)


async def test_streams_that_finish_or_are_refused_keep_their_codes(served):
    metrics, channel = served
    assert [reply async for reply in _call(channel, "Two")] == [b"a", b"b"]
    with pytest.raises(aio.AioRpcError) as refused:
        await _call(channel, "Refuse").read()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "refused on purpose"

    async def counts():
        return _count(metrics, "Two", "OK"), _count(metrics, "Refuse", "INVALID_ARGUMENT")

    assert await poll_until(counts, lambda c: c == (1, 1), "both streams recorded") == (1, 1)
    assert _count(metrics, "Two", "CANCELLED") == 0


async def test_a_handler_cut_short_by_a_closed_channel_of_its_own_answers_unavailable():
    """A handler waiting on a call of its own whose channel is closed under it (an etcd client
    reset mid-call, as a store replica's was when the etcd leader died) ends with a cancellation
    its caller never asked for: the caller gets UNAVAILABLE at once, not silence until its
    deadline."""
    upstream = aio.server()
    upstream.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(SERVICE, {"Forever": _handler(_forever)})]
    )
    upstream_port = upstream.add_insecure_port("127.0.0.1:0")
    await upstream.start()
    inner = aio.insecure_channel(f"127.0.0.1:{upstream_port}")
    waiting = asyncio.Event()

    async def relay(request: bytes, context):
        call = _call(inner, "Forever")
        await call.read()
        waiting.set()
        await call.read()  # never answers: only the channel's close ends it
        return b"unreachable"

    metrics = ServiceMetrics("test")
    server = aio.server(interceptors=[ServiceInterceptor(metrics)])
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                SERVICE, {"Relay": grpc.unary_unary_rpc_method_handler(relay, lambda b: b, lambda b: b)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        call = channel.unary_unary(f"/{SERVICE}/Relay", lambda b: b, lambda b: b)(b"", timeout=HANG_GUARD_S)
        await asyncio.wait_for(waiting.wait(), HANG_GUARD_S)
        await inner.close()
        with pytest.raises(aio.AioRpcError) as ended:
            await call
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value
        assert "Relay" in ended.value.details()
        assert _count(metrics, "Relay", "UNAVAILABLE") == 1
    finally:
        await channel.close()
        await server.stop(None)
        await upstream.stop(None)
