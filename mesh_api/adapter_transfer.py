"""How an adapter crosses the wire: a PEFT directory as a ``RegisterAdapter`` message stream
(header, then chunks of at most ``upload_wire.UPLOAD_CHUNK_BYTES``), adapter references, and a
fetch verified against the store's sha256.

The one copy of these rules: the SDK builds its uploads with it (through the gateway), the gateway
forwards with it, the workers fetch with it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Protocol

from grpc import aio

from mesh_api.upload_wire import upload_wire
from mesh_api.v1 import adapter_store_pb2 as pb
from mesh_api.v1 import adapter_store_pb2_grpc, types_pb2

UPLOAD_FILES = (
    "adapter_config.json",
    "adapter_model.safetensors",
    "tokenizer_config.json",
    "chat_template.jinja",
)
"""The files of a PEFT directory an upload sends, when present: the adapter (both required by the
store) and the tokenizer files whose chat template the adapter is served with (optional)."""


IMPORT_SCHEMES = ("s3", "hf", "file")
"""URI schemes the adapter store imports adapters from (``ImportAdapter``)."""


def is_import_uri(location: str) -> bool:
    """Whether ``location`` is a URI to import (``s3://``, ``hf://``, ``file://``), not a path."""
    scheme, sep, _ = location.partition("://")
    return bool(sep) and scheme.lower() in IMPORT_SCHEMES


class ChecksumMismatch(Exception):
    """A fetched adapter's bytes do not match the sha256 the store announced."""


async def _awaited(answer: Awaitable):
    return await answer


def ref_by_name(owner: str, name: str) -> pb.AdapterRef:
    return pb.AdapterRef(owned_name=pb.OwnedName(owner=owner, name=name))


def ref_by_id(adapter_id: str) -> pb.AdapterRef:
    return pb.AdapterRef(id=adapter_id)


def read_adapter_dir(directory: str | Path) -> dict[str, bytes]:
    """The files of a PEFT adapter directory that the store takes, read by whoever uploads them
    (the SDK, ``loramesh up --lora-modules``) with its own permissions, links followed: it is the
    caller's directory. No service reads a path for a tenant with it: the gateway's path load is
    the store's ``file://`` import, confined and policy-checked
    (:meth:`services.gateway.adapter_admin.AdapterAdmin.load_adapter_dir`); an upload over the
    size limit is refused by the store."""
    directory = Path(directory)
    files = {name: (directory / name).read_bytes() for name in UPLOAD_FILES if (directory / name).exists()}
    if (directory / "adapter_model.bin").exists() and "adapter_model.safetensors" not in files:
        files["adapter_model.bin"] = (directory / "adapter_model.bin").read_bytes()
    return files


def upload_requests(
    files: dict[str, bytes], name: str, owner: str, visibility: int = types_pb2.VISIBILITY_PRIVATE
) -> Iterator[pb.RegisterAdapterRequest]:
    """The RegisterAdapter message stream as protobuf messages, for the generated stubs (a plain
    iterator: sync and aio stubs both take it). :func:`mesh_api.upload_wire.upload_wire` is the
    same stream serialized, which a wire stub sends with fewer copies."""
    return map(pb.RegisterAdapterRequest.FromString, upload_wire(files, name, owner, visibility))


async def upload_adapter(
    stub: adapter_store_pb2_grpc.AdapterStoreStub,
    files: dict[str, bytes],
    name: str,
    owner: str,
    visibility: int = types_pb2.VISIBILITY_PRIVATE,
    timeout: float | None = 120,
    metadata=None,
) -> types_pb2.AdapterInfo:
    reply = await stub.RegisterAdapter(
        upload_requests(files, name, owner, visibility), timeout=timeout, metadata=metadata
    )
    return reply.adapter


async def fetch_adapter(
    stub: adapter_store_pb2_grpc.AdapterStoreStub,
    ref: pb.AdapterRef,
    timeout: float | None = 120,
    first_answer: Callable[[Awaitable], Awaitable] | None = None,
) -> tuple[types_pb2.AdapterInfo, bytearray]:
    """Download an adapter's weights and verify them against the announced sha256 (the
    ``AdapterInfo``'s ``sha256``): :func:`fetch_adapter_chunks`, the chunks joined."""
    info, chunks = await fetch_adapter_chunks(stub, ref, timeout, first_answer)
    data, filled = bytearray(sum(len(chunk) for chunk in chunks)), 0
    for chunk in chunks:
        data[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
    return info, data


class BlobFileReader(Protocol):
    """What a fetching process does with a blob file the store names instead of sending it."""

    file_system: str
    """The process's file system (``FetchAdapterRequest.file_system``)."""

    async def read(self, path: str, size: int, sha256: str) -> memoryview | None:
        """The file's bytes when they are ``size`` bytes whose sha256 is ``sha256``; None when it
        cannot be read here or holds anything else."""
        ...


async def fetch_adapter_chunks(
    stub: adapter_store_pb2_grpc.AdapterStoreStub,
    ref: pb.AdapterRef,
    timeout: float | None = 120,
    first_answer: Callable[[Awaitable], Awaitable] | None = None,
    blob_files: BlobFileReader | None = None,
) -> tuple[types_pb2.AdapterInfo, list[bytes | memoryview]]:
    """Download an adapter's weights and verify them against the announced sha256 (the
    ``AdapterInfo``'s ``sha256``), as the chunks they arrived in (a worker parses them where
    they are: ``services.gpu_worker.lora.safetensors_views``). ``first_answer(read)``: awaits the
    read of the first message (a caller bounds the wait there, cancelling the call when it gives
    up). ``blob_files``: offered to a replica on the same file system, which then names its blob
    file instead of sending it; read and checked by ``blob_files``, else fetched again as chunks.

    Each chunk is hashed as it arrives, while the next is on its way: nothing is joined or
    hashed over the whole at the end."""
    file_system = blob_files.file_system if blob_files is not None else ""
    request = pb.FetchAdapterRequest(ref=ref, file_system=file_system)
    call = stub.FetchAdapter(request, timeout=timeout)
    try:
        message = await (first_answer or _awaited)(call.read())
    except BaseException:
        call.cancel()
        raise
    if message is aio.EOF or message.WhichOneof("item") != "header":
        call.cancel()
        raise ChecksumMismatch(f"adapter {ref} arrived without its header")
    header = message.header
    if header.adapter.sha256 not in ("", header.sha256):
        call.cancel()
        raise ChecksumMismatch(f"adapter {ref} announced two sha256s")
    if header.blob_path and blob_files is not None:
        call.cancel()  # nothing follows a named file
        data = await blob_files.read(header.blob_path, header.total_bytes, header.sha256)
        if data is not None:
            return header.adapter, [data]
        return await fetch_adapter_chunks(stub, ref, timeout, first_answer)
    chunks: list[bytes | memoryview] = []
    filled, digest = 0, hashlib.sha256()
    while (message := await call.read()) is not aio.EOF:
        chunk = message.chunk
        if message.WhichOneof("item") != "chunk" or filled + len(chunk) > header.total_bytes:
            call.cancel()
            raise ChecksumMismatch(f"adapter {ref} arrived corrupted (more than {header.total_bytes} bytes)")
        chunks.append(chunk)
        filled += len(chunk)
        digest.update(chunk)
    if filled != header.total_bytes or digest.hexdigest() != header.sha256:
        raise ChecksumMismatch(f"adapter {ref} arrived corrupted ({filled} bytes)")
    return header.adapter, chunks
