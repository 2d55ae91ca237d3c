"""RegisterAdapter's requests as wire bytes: read (chunk data as views), they mean exactly what
protobuf reads in them, for every shape a client may send; written by hand, protobuf reads them
as the messages it would have built."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from mesh_api.adapter_transfer import upload_requests
from mesh_api.upload_wire import UPLOAD_CHUNK_BYTES, chunk_wire, read_upload_message, upload_wire
from mesh_api.v1 import adapter_store_pb2 as pb

Chunk = pb.RegisterAdapterRequest.FileChunk


def assert_reads_as_protobuf(raw: bytes) -> None:
    message = pb.RegisterAdapterRequest.FromString(raw)
    read = read_upload_message(raw)
    is_header = message.WhichOneof("item") == "header"
    assert (read.header is not None) == is_header
    if is_header:
        assert read.header == message.header
    assert read.filename == message.chunk.filename
    assert bytes(read.data) == message.chunk.data
    assert read.wire is raw


@given(filename=st.text(max_size=40), data=st.binary(max_size=3000))
def test_a_chunk_reads_as_protobuf_reads_it(filename, data):
    assert_reads_as_protobuf(
        pb.RegisterAdapterRequest(chunk=Chunk(filename=filename, data=data)).SerializeToString()
    )


def test_a_chunk_data_is_a_view_of_the_message_bytes():
    raw = pb.RegisterAdapterRequest(
        chunk=Chunk(filename="adapter_model.safetensors", data=b"x" * 5000)
    ).SerializeToString()
    read = read_upload_message(raw)
    assert read.data.obj is raw
    assert bytes(read.data) == b"x" * 5000


def test_every_message_of_an_upload_reads_as_protobuf():
    files = {"adapter_config.json": b"{}", "adapter_model.safetensors": bytes(range(256)) * 9000}
    for message in upload_requests(files, "name", "owner"):
        assert_reads_as_protobuf(message.SerializeToString())


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (numbers and lengths below 128: one-byte tag and length)."""
    return bytes([number << 3 | 2, len(payload)]) + payload


@pytest.mark.parametrize(
    "raw",
    [
        b"",  # an empty message: neither header nor chunk
        field(2, b""),  # an empty chunk
        field(2, field(2, b"data") + field(1, b"name")),  # data before filename
        field(2, field(1, b"a") + field(1, b"b") + field(2, b"d")),  # a repeated field: the last wins
        field(2, field(1, b"a") + bytes([3 << 3, 5]) + field(2, b"d")),  # an unknown varint field
        field(2, field(1, b"a")) + field(2, field(2, b"d")),  # two chunks: protobuf merges them
        field(2, field(1, b"a")) + field(1, field(1, b"n")),  # a chunk, then a header: the oneof's last
        field(1, field(1, b"n") + field(2, b"o")),  # a header
        bytes([0x12, 0x80, 0x01]) + field(1, b"f") + bytes([0x12, 0x7B]) + b"d" * 123,  # two-byte length
    ],
)
def test_other_shapes_read_as_protobuf_reads_them(raw):
    assert_reads_as_protobuf(raw)


@pytest.mark.parametrize(
    "raw",
    [
        field(2, field(1, b"\xff\xfe")),  # a filename that is not UTF-8
        bytes([0x12, 0x05]) + field(1, b"abc")[:3],  # the chunk is shorter than its length
        bytes([0x12, 0x04, 0x12, 0x09, 0x00, 0x00]),  # data longer than its chunk
        bytes([0x12]) + bytes([0x80] * 11),  # a varint that never ends
    ],
)
def test_bytes_that_are_no_message_are_refused_as_protobuf_refuses_them(raw):
    with pytest.raises(DecodeError):
        pb.RegisterAdapterRequest.FromString(raw)
    with pytest.raises(DecodeError):
        read_upload_message(raw)


@given(filename=st.text(max_size=40), data=st.binary(max_size=70000))
def test_a_chunk_written_by_hand_is_the_message_protobuf_would_build(filename, data):
    built = pb.RegisterAdapterRequest(chunk=Chunk(filename=filename, data=data))
    assert pb.RegisterAdapterRequest.FromString(chunk_wire(filename, memoryview(data))) == built


def test_an_upload_written_by_hand_is_the_stream_protobuf_would_build():
    files = {
        "adapter_config.json": b"{}",
        "adapter_model.safetensors": bytes(range(256)) * (UPLOAD_CHUNK_BYTES * 9 // 4 // 256),
        "empty": b"",
    }
    weights = files["adapter_model.safetensors"]
    header = pb.RegisterAdapterRequest.Header(
        name="name", owner="owner", visibility=2, total_bytes=2 + len(weights)
    )
    built = [
        pb.RegisterAdapterRequest(header=header),
        pb.RegisterAdapterRequest(chunk=Chunk(filename="adapter_config.json", data=b"{}")),
        *(
            pb.RegisterAdapterRequest(
                chunk=Chunk(filename="adapter_model.safetensors", data=weights[i : i + UPLOAD_CHUNK_BYTES])
            )
            for i in range(0, len(weights), UPLOAD_CHUNK_BYTES)
        ),
        pb.RegisterAdapterRequest(chunk=Chunk(filename="empty", data=b"")),
    ]
    assert len(built) == 1 + 1 + 3 + 1  # a header, the config, three chunks of the weights, the empty file
    written = [
        pb.RegisterAdapterRequest.FromString(raw) for raw in upload_wire(files, "name", "owner", visibility=2)
    ]
    assert written == built
    assert list(upload_requests(files, "name", "owner", visibility=2)) == built
