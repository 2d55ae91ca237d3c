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
from services.runtime.errors import NotFound
from services.runtime.interceptors import MAX_STATUS_MESSAGE_BYTES, ServiceInterceptor

SERVICE = "test.Input"
Request = gateway_pb2.GatewayAdapterRequest


async def _echo(request: Request, context) -> Request:
    return request


async def _count(requests, context) -> Request:
    seen = [r async for r in requests]
    return Request(adapter=str(len(seen)))


async def _not_found(request: Request, context) -> Request:
    raise NotFound(f"adapter {request.adapter!r} not found")


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
