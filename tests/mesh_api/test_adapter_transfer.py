"""A fetch verifies what arrives: the announced size and sha256, the header first; anything else
is a ChecksumMismatch (real gRPC on loopback, a store that sends what each case says)."""

from __future__ import annotations

import hashlib

import grpc
import pytest
from grpc import aio

from mesh_api.adapter_transfer import ChecksumMismatch, fetch_adapter, ref_by_id
from mesh_api.v1 import adapter_store_pb2 as pb
from mesh_api.v1 import adapter_store_pb2_grpc, types_pb2

WEIGHTS = bytes(range(256)) * 9000
"""2.3 MB: three chunks of at most 1 MiB."""


def header(data: bytes, sha256: str | None = None, info_sha256: str | None = None) -> pb.FetchAdapterResponse:
    sha256 = sha256 or hashlib.sha256(data).hexdigest()
    adapter = types_pb2.AdapterInfo(id="a", sha256=sha256 if info_sha256 is None else info_sha256)
    return pb.FetchAdapterResponse(
        header=pb.FetchAdapterResponse.Header(adapter=adapter, total_bytes=len(data), sha256=sha256)
    )


def chunks(data: bytes) -> list[pb.FetchAdapterResponse]:
    return [pb.FetchAdapterResponse(chunk=data[i : i + 2**20]) for i in range(0, len(data), 2**20)]


class ScriptedStore(adapter_store_pb2_grpc.AdapterStoreServicer):
    def __init__(self):
        self.messages: list[pb.FetchAdapterResponse] = []
        self.refusal: grpc.StatusCode | None = None

    async def FetchAdapter(self, request, context):
        if self.refusal is not None:
            await context.abort(self.refusal, "no such adapter")
        for message in self.messages:
            yield message


@pytest.fixture
async def store():
    servicer = ScriptedStore()
    server = aio.server()
    adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield servicer, adapter_store_pb2_grpc.AdapterStoreStub(channel)
    await server.stop(None)


async def test_the_weights_arrive_whole_with_the_adapter_they_belong_to(store):
    servicer, stub = store
    servicer.messages = [header(WEIGHTS), *chunks(WEIGHTS)]
    info, data = await fetch_adapter(stub, ref_by_id("a"))
    assert info.id == "a" and data == WEIGHTS


@pytest.mark.parametrize(
    ("messages", "what"),
    [
        ([header(WEIGHTS), *chunks(WEIGHTS[:-1])], "arrived corrupted"),
        ([header(WEIGHTS), *chunks(WEIGHTS + b"x")], "more than"),
        ([header(WEIGHTS), *chunks(b"\xff" + WEIGHTS[1:])], "arrived corrupted"),
        ([header(WEIGHTS, sha256="0" * 64), *chunks(WEIGHTS)], "arrived corrupted"),
        ([header(WEIGHTS, info_sha256="1" * 64), *chunks(WEIGHTS)], "two sha256s"),
        ([*chunks(WEIGHTS), header(WEIGHTS)], "without its header"),
        ([], "without its header"),
        ([header(WEIGHTS), *chunks(WEIGHTS), header(WEIGHTS)], "more than"),
    ],
    ids=["short", "long", "changed", "wrong-sha", "two-shas", "header-last", "empty", "two-headers"],
)
async def test_anything_else_is_a_checksum_mismatch(store, messages, what):
    servicer, stub = store
    servicer.messages = messages
    with pytest.raises(ChecksumMismatch, match=what):
        await fetch_adapter(stub, ref_by_id("a"))


async def test_a_refusal_is_the_stores_status(store):
    servicer, stub = store
    servicer.refusal = grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as raised:
        await fetch_adapter(stub, ref_by_id("a"))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
