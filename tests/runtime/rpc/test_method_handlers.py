"""A generated servicer added with its own request reader for one method: that method's requests
reach the servicer as the reader returns them, every other method's as protobuf messages, and
undecodable bytes are still INVALID_ARGUMENT. A real loopback server."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc import aio

from mesh_api.v1 import adapter_store_pb2 as pb
from mesh_api.v1 import adapter_store_pb2_grpc, types_pb2
from services.runtime.rpc.interceptors import ServiceInterceptor
from services.runtime.rpc.method_handlers import add_servicer_with_readers


def read_length(raw: bytes) -> int:
    if raw == b"\xff":
        raise DecodeError("not a message")
    return len(raw)


class Servicer(adapter_store_pb2_grpc.AdapterStoreServicer):
    async def RegisterAdapter(self, requests, context):
        sizes = [size async for size in requests]
        return pb.RegisterAdapterResponse(adapter=types_pb2.AdapterInfo(name=repr(sizes)))

    async def GetAdapter(self, request, context):
        return types_pb2.AdapterInfo(name=f"{type(request).__name__} {request.ref.id}")


@pytest.fixture
async def channel():
    server = aio.server(interceptors=[ServiceInterceptor()])
    add_servicer_with_readers(
        server,
        adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server,
        Servicer(),
        {"RegisterAdapter": read_length},
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    await server.stop(None)


async def test_the_named_method_reads_with_the_reader_and_the_others_with_protobuf(channel):
    stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
    messages = [
        pb.RegisterAdapterRequest(chunk=pb.RegisterAdapterRequest.FileChunk(data=b"x" * n)) for n in (1, 300)
    ]
    reply = await stub.RegisterAdapter(iter(messages))
    assert reply.adapter.name == repr([m.ByteSize() for m in messages])
    reply = await stub.GetAdapter(pb.GetAdapterRequest(ref=pb.AdapterRef(id="a1")))
    assert reply.name == "GetAdapterRequest a1"


async def test_bytes_the_reader_refuses_are_invalid_argument(channel):
    register = channel.stream_unary(
        "/loramesh.v1.AdapterStore/RegisterAdapter",
        request_serializer=lambda raw: raw,
        response_deserializer=pb.RegisterAdapterResponse.FromString,
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await register(iter([b"\x0a\x00", b"\xff"]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_method_the_service_lacks_is_refused():
    with pytest.raises(ValueError, match="NoSuchMethod"):
        add_servicer_with_readers(
            aio.server(),
            adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server,
            Servicer(),
            {"NoSuchMethod": len},
        )
