"""What the interceptor answers to input a handler never sees: a request whose bytes do not parse
is INVALID_ARGUMENT (not grpc's UNKNOWN), in a unary call and in the middle of a request stream,
and a refusal that echoes a huge input keeps its own status (its message is cut: past 8 KiB of
trailing metadata a client reports RESOURCE_EXHAUSTED instead). Found by the fuzz tests
(tests/gateway/test_fuzz_grpc.py); a real loopback server."""

from __future__ import annotations

import grpc
import pytest
from grpc import aio

from mesh_api.v1 import gateway_pb2
from services.runtime.errors import NotFound, PermissionDenied
from services.runtime.rpc import interceptors
from services.runtime.rpc.interceptors import MAX_STATUS_MESSAGE_BYTES, ServiceInterceptor

SERVICE = "test.Input"
Request = gateway_pb2.GatewayAdapterRequest


async def _echo(request: Request, context) -> Request:
    return request


async def _count(requests, context) -> Request:
    seen = [r async for r in requests]
    return Request(adapter=str(len(seen)))


async def _not_found(request: Request, context) -> Request:
    raise NotFound(f"adapter {request.adapter!r} not found")


async def _refuse_at_once(requests, context) -> Request:
    raise PermissionDenied("refused before the stream is read")


async def _refuse_after_one(requests, context) -> Request:
    async for _ in requests:
        raise PermissionDenied("refused after one message")


@pytest.fixture
async def channel():
    server = aio.server(interceptors=[ServiceInterceptor()])
    parse, write = Request.FromString, Request.SerializeToString
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    "Echo": grpc.unary_unary_rpc_method_handler(_echo, parse, write),
                    "Count": grpc.stream_unary_rpc_method_handler(_count, parse, write),
                    "NotFound": grpc.unary_unary_rpc_method_handler(_not_found, parse, write),
                    "RefuseAtOnce": grpc.stream_unary_rpc_method_handler(_refuse_at_once, parse, write),
                    "RefuseAfterOne": grpc.stream_unary_rpc_method_handler(_refuse_after_one, parse, write),
                },
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    await server.stop(None)


async def test_a_request_that_does_not_parse_is_invalid_argument(channel):
    echo = channel.unary_unary(f"/{SERVICE}/Echo")
    assert await echo(Request(adapter="ok").SerializeToString()) == Request(adapter="ok").SerializeToString()
    with pytest.raises(aio.AioRpcError) as refused:
        await echo(b"\x00")  # field number 0: no protobuf message
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid message" in refused.value.details()


async def test_a_message_that_does_not_parse_in_a_stream_is_invalid_argument(channel):
    count = channel.stream_unary(f"/{SERVICE}/Count")
    good = Request(adapter="a").SerializeToString()
    assert await count(iter([good, good])) == Request(adapter="2").SerializeToString()
    with pytest.raises(aio.AioRpcError) as refused:
        await count(iter([good, b"\xff\xff"]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_refusal_echoing_a_huge_input_keeps_its_status(channel):
    with pytest.raises(aio.AioRpcError) as refused:
        await channel.unary_unary(f"/{SERVICE}/NotFound")(Request(adapter="\n" * 20_000).SerializeToString())
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    details = refused.value.details()
    assert details.startswith("adapter '\\n") and details.endswith("...")
    assert len(details.encode()) <= MAX_STATUS_MESSAGE_BYTES


def upload_like(messages: int):
    """An upload's shape: 64 KiB messages, far past the connection's first flow-control window."""
    chunk = Request(adapter="x" * 65536).SerializeToString()
    return (chunk for _ in range(messages))


@pytest.mark.parametrize("method", ["RefuseAtOnce", "RefuseAfterOne"])
async def test_a_refused_request_stream_gets_its_own_status_while_the_caller_still_sends(channel, method):
    """The refusal waits for the rest of the stream: without that, 2 to 5 uploads in 300 ended
    INTERNAL ("Internal error from Core": the caller's write failed) instead of their status."""
    refuse = channel.stream_unary(f"/{SERVICE}/{method}")
    codes = []
    for _ in range(100):
        with pytest.raises(aio.AioRpcError) as refused:
            await refuse(upload_like(32))
        codes.append(refused.value.code())
    assert set(codes) == {grpc.StatusCode.PERMISSION_DENIED}


async def test_a_refused_stream_past_the_bound_is_answered_before_its_end(channel, monkeypatch):
    """Past the bound the answer goes anyway (the caller may then see its write fail): the caller's
    64 MiB stream ends with the answer after about the 1 MiB bound has been read, not after its
    last message (HTTP/2 flow control keeps it from sending much past what the server read). The
    stream is finite, so even a server that read it all would answer."""
    monkeypatch.setattr(interceptors, "DRAIN_BYTES", 1 << 20)
    total = 1024  # 64 KiB messages: 64 MiB
    sent = 0

    def long_stream():
        nonlocal sent
        chunk = Request(adapter="x" * 65536).SerializeToString()
        for _ in range(total):
            sent += 1
            yield chunk

    with pytest.raises(aio.AioRpcError) as refused:
        await channel.stream_unary(f"/{SERVICE}/RefuseAtOnce")(long_stream())
    assert refused.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INTERNAL)
    assert sent < total, "the answer waited for the whole stream"
