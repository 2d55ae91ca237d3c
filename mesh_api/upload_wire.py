"""``RegisterAdapterRequest`` messages as wire bytes, written and read without copying a chunk's
data more than once.

Why: every upload's bytes pass the event-loop thread of each service on its way (the gateway's,
then the adapter store's), a message at a time, and that thread is the serial part of
registration. Protobuf copies a chunk's data when it parses a message and again when the
``data`` field is read; building a message copies it too, and serializing it once more. Copies
were half of the store's loop thread at ~400 MB/s (``perf``, issue 30). Here a chunk read is a
view into the bytes grpc delivered, a relayed chunk is sent as the bytes it arrived as, and a
chunk written is its data copied once, behind its two field headers. A message of any other
shape (a header, unknown or repeated fields) is read by protobuf, so what a message means never
differs from protobuf's reading.

Senders use stubs whose upload call takes wire bytes (:class:`WireUploadGatewayStub`, the SDK's;
:class:`WireUploadAdapterStoreStub`, the gateway's); receivers add their servicer with
:func:`read_upload_message` as the upload's request reader (``services.runtime.rpc.method_handlers``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from mesh_api.v1 import adapter_store_pb2 as pb
from mesh_api.v1 import adapter_store_pb2_grpc, gateway_pb2_grpc, types_pb2

UPLOAD_CHUNK_BYTES = (4 << 20) - 4096
"""Most bytes of a file one ``RegisterAdapter`` message carries. Each message costs the sender,
the gateway and the store a fixed amount of work besides its bytes: uploads of real-size adapters
(5 MB on average) in 4 MiB messages instead of 1 MiB took 4 % less of the store's CPU per MB, 13 %
less of the client's and 10 % less of a relaying gateway's, on two vCPUs (docs/benchmarks.md). A page
short of 4 MiB, so that a message with its framing stays within gRPC's default receive limit
(4 MiB) for any server on the way, not only the mesh's (64 MiB)."""
REGISTER_ADAPTER_METHOD = "/loramesh.v1.AdapterStore/RegisterAdapter"
UPLOAD_ADAPTER_METHOD = "/loramesh.v1.Gateway/UploadAdapter"

_CHUNK_TAG = 0x12
"""``RegisterAdapterRequest.chunk`` (field 2, length-delimited): the first byte of a chunk message."""
_FILENAME_TAG = 0x0A
"""``FileChunk.filename`` (field 1, length-delimited)."""
_DATA_TAG = 0x12
"""``FileChunk.data`` (field 2, length-delimited)."""


@dataclass(frozen=True, slots=True)
class UploadMessage:
    """One ``RegisterAdapterRequest``: its header, or one chunk of a file, or neither (empty)."""

    header: pb.RegisterAdapterRequest.Header | None
    filename: str
    data: memoryview
    """The chunk's bytes: a view into :attr:`wire` when it was read uncopied."""
    wire: bytes
    """The message as it arrived."""


def read_upload_message(raw: bytes) -> UploadMessage:
    """``raw`` (a serialized ``RegisterAdapterRequest``) as an :class:`UploadMessage`; raises
    protobuf's ``DecodeError`` when the bytes are not such a message."""
    chunk = _plain_chunk(raw)
    if chunk is not None:
        return chunk
    message = pb.RegisterAdapterRequest.FromString(raw)
    header = message.header if message.WhichOneof("item") == "header" else None
    return UploadMessage(header, message.chunk.filename, memoryview(message.chunk.data), raw)


def header_wire(header: pb.RegisterAdapterRequest.Header) -> bytes:
    """The ``RegisterAdapterRequest`` carrying ``header``, serialized."""
    return pb.RegisterAdapterRequest(header=header).SerializeToString()


def chunk_wire(filename: str, data) -> bytes:
    """A ``RegisterAdapterRequest`` carrying ``data`` (bytes-like) of ``filename`` (protobuf
    reads it as the message it would have built), with ``data`` copied once."""
    name = filename.encode("utf-8")
    name_field = bytes([_FILENAME_TAG]) + _encode_varint(len(name)) + name
    data_header = bytes([_DATA_TAG]) + _encode_varint(len(data))
    body_len = len(name_field) + len(data_header) + len(data)
    return b"".join((bytes([_CHUNK_TAG]), _encode_varint(body_len), name_field, data_header, data))


def upload_wire(
    files: Mapping[str, bytes],
    name: str,
    owner: str,
    visibility: int = types_pb2.VISIBILITY_PRIVATE,
    new_version: bool = False,
) -> Iterator[bytes]:
    """The RegisterAdapter message stream of ``files`` as wire bytes: a header, then each file
    in chunks of at most :data:`UPLOAD_CHUNK_BYTES` (an empty file as one empty chunk).
    ``new_version``: a publish (a name already registered gets its next version)."""
    total = sum(len(data) for data in files.values())
    yield header_wire(
        pb.RegisterAdapterRequest.Header(
            name=name, owner=owner, visibility=visibility, total_bytes=total, new_version=new_version
        )
    )
    for filename, data in files.items():
        view = memoryview(data)
        for start in range(0, max(len(view), 1), UPLOAD_CHUNK_BYTES):
            yield chunk_wire(filename, view[start : start + UPLOAD_CHUNK_BYTES])


def _wire_upload_call(channel, method: str):
    """``method`` on ``channel`` (sync or asyncio) taking its request messages as wire bytes."""
    return channel.stream_unary(
        method, request_serializer=None, response_deserializer=pb.RegisterAdapterResponse.FromString
    )


class WireUploadAdapterStoreStub(adapter_store_pb2_grpc.AdapterStoreStub):
    """The generated stub, except that ``RegisterAdapter`` takes its messages as wire bytes
    (:func:`upload_wire`, or relayed :attr:`UploadMessage.wire`)."""

    def __init__(self, channel):
        super().__init__(channel)
        self.RegisterAdapter = _wire_upload_call(channel, REGISTER_ADAPTER_METHOD)


class WireUploadGatewayStub(gateway_pb2_grpc.GatewayStub):
    """The generated stub, except that ``UploadAdapter`` takes its messages as wire bytes
    (:func:`upload_wire`)."""

    def __init__(self, channel):
        super().__init__(channel)
        self.UploadAdapter = _wire_upload_call(channel, UPLOAD_ADAPTER_METHOD)


def _plain_chunk(raw: bytes) -> UploadMessage | None:
    """A message that is exactly one chunk holding a filename and data, each once (what
    :func:`chunk_wire` and every protobuf serializer write); None for anything else, which
    protobuf then reads."""
    view = memoryview(raw)
    if len(view) < 2 or view[0] != _CHUNK_TAG:
        return None
    body_start, body_len = _read_varint(view, 1)
    if body_start + body_len != len(view):
        return None
    fields: dict[int, memoryview] = {}
    position = body_start
    while position < len(view):
        tag = view[position]
        if tag not in (_FILENAME_TAG, _DATA_TAG) or tag in fields:
            return None
        start, length = _read_varint(view, position + 1)
        if start + length > len(view):
            raise DecodeError("a FileChunk field runs past the end of its message")
        fields[tag] = view[start : start + length]
        position = start + length
    try:
        filename = str(fields.get(_FILENAME_TAG, b""), "utf-8")
    except UnicodeDecodeError:
        raise DecodeError("FileChunk.filename is not valid UTF-8") from None
    return UploadMessage(None, filename, fields.get(_DATA_TAG, view[:0]), raw)


def _read_varint(view: memoryview, position: int) -> tuple[int, int]:
    """The base-128 varint at ``position``: (the position after it, its value)."""
    value = shift = 0
    while position < len(view) and shift < 64:
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return position, value
        shift += 7
    raise DecodeError("a length varint is truncated or longer than 10 bytes")


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
