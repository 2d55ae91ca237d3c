"""``RegisterAdapter``'s request messages read from their wire bytes, a chunk's data uncopied.

Why: every upload's bytes pass the store's one event-loop thread, a message at a time, and that
thread is the serial part of registration. Protobuf's parse copied each chunk's data once and
reading the ``data`` field copied it again: copies were half of that thread's time while
registering real-size adapters at ~400 MB/s (``perf``, issue 30). Here a chunk's ``data`` is a
view into the bytes grpc delivered. A message of any other shape (a header, unknown or repeated
fields) is parsed by protobuf, so what a message means never differs from protobuf's reading.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from mesh_api.v1 import adapter_store_pb2 as pb

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
    """The chunk's bytes: a view into the message's own bytes when it was read uncopied."""
    wire_bytes: int
    """The message's size on the wire."""


def read_upload_message(raw: bytes) -> UploadMessage:
    """``raw`` (a serialized ``RegisterAdapterRequest``) as an :class:`UploadMessage`; raises
    protobuf's ``DecodeError`` when the bytes are not such a message."""
    chunk = _plain_chunk(raw)
    if chunk is not None:
        return chunk
    message = pb.RegisterAdapterRequest.FromString(raw)
    header = message.header if message.WhichOneof("item") == "header" else None
    return UploadMessage(header, message.chunk.filename, memoryview(message.chunk.data), len(raw))


def _plain_chunk(raw: bytes) -> UploadMessage | None:
    """A message that is exactly one chunk holding a filename then data, each once (what
    ``mesh_api.adapter_transfer.upload_requests`` and every protobuf serializer write); None for
    anything else, which protobuf then reads."""
    view = memoryview(raw)
    if len(view) < 2 or view[0] != _CHUNK_TAG:
        return None
    body_start, body_len = _varint(view, 1)
    if body_start + body_len != len(view):
        return None
    fields: dict[int, memoryview] = {}
    position = body_start
    while position < len(view):
        tag = view[position]
        if tag not in (_FILENAME_TAG, _DATA_TAG) or tag in fields:
            return None
        start, length = _varint(view, position + 1)
        if start + length > len(view):
            raise DecodeError("a FileChunk field runs past the end of its message")
        fields[tag] = view[start : start + length]
        position = start + length
    try:
        filename = str(fields.get(_FILENAME_TAG, b""), "utf-8")
    except UnicodeDecodeError:
        raise DecodeError("FileChunk.filename is not valid UTF-8") from None
    return UploadMessage(None, filename, fields.get(_DATA_TAG, view[:0]), len(view))


def _varint(view: memoryview, position: int) -> tuple[int, int]:
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
