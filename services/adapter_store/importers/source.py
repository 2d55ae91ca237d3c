"""The interface every importer implements, and the one fetch loop that uses it.

An import lists the adapter's files first (names, sizes, a version tag) and only then reads
them, so an oversized adapter is refused before any byte is read, and a file that changes
between the listing and the read is caught instead of mixing two versions of an adapter.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO

from mesh_api.adapter_transfer import UPLOAD_FILES
from services.adapter_store.blobs.page_aligned import page_aligned_empty
from services.runtime.errors import FailedPrecondition, ResourceExhausted

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE)
"""Without these a source holds no PEFT adapter; the other ``UPLOAD_FILES`` are optional."""
IMPORTED_FILES = UPLOAD_FILES
"""What an import takes from a source: exactly what an upload sends."""


@dataclass(frozen=True)
class SourceFile:
    """One file of an adapter at its source, as the listing saw it."""

    name: str
    """The file's name in the adapter (one of ``IMPORTED_FILES``)."""
    location: str
    """Where it is, as a URI (what error messages name)."""
    size: int
    """Bytes, from the listing."""
    version: str
    """What identifies this content at the source (ETag, commit, size and mtime): a read that
    finds another version refuses the import."""


class AdapterImportSource(ABC):
    """An adapter directory somewhere the store can read (a bucket prefix, a Hub repo, a path)."""

    uri: str
    """The URI it was opened from."""

    @abstractmethod
    def list_files(self) -> list[SourceFile]:
        """The ``IMPORTED_FILES`` present; raises a domain error when the source does not exist
        or lacks a ``REQUIRED_FILES`` entry."""

    @abstractmethod
    def read(self, file: SourceFile, max_bytes: int) -> memoryview:
        """The bytes of ``file`` (read by :func:`read_capped`), refusing more than ``max_bytes``;
        FailedPrecondition when its content is no longer the listed ``file.version``."""


def fetch_adapter_files(source: AdapterImportSource, max_bytes: int) -> dict[str, memoryview]:
    """The adapter's files by name, at most ``max_bytes`` in all (the store's upload limit)."""
    listed = source.list_files()
    total = sum(f.size for f in listed)
    if total > max_bytes:
        largest = max(listed, key=lambda f: f.size)
        raise ResourceExhausted(
            f"{source.uri} holds {total} bytes of adapter files (largest {largest.location}, "
            f"{largest.size} bytes), over the size limit of {max_bytes} bytes"
        )
    files: dict[str, memoryview] = {}
    for file in listed:
        data = source.read(file, max_bytes - sum(len(d) for d in files.values()))
        if len(data) != file.size:
            raise changed_during_import(file, f"listed with {file.size} bytes, read {len(data)}")
        files[file.name] = data
    return files


def read_capped(stream: BinaryIO, file: SourceFile, max_bytes: int) -> memoryview:
    """``file``'s ``stream`` to its end, or to one byte past its listed size (enough to tell
    that it grew since the listing), refused (ResourceExhausted) once it passes ``max_bytes``.

    Read straight into page-aligned memory (one copy), from which the blob store writes its
    whole pages to disk without another: an import costs the CPU of its hash, not of its copies."""
    limit = min(file.size, max_bytes) + 1
    buffer = page_aligned_empty(limit)
    received = 0
    while received < limit and (count := stream.readinto(buffer[received:])):
        received += count
    if received > max_bytes:
        raise ResourceExhausted(f"{file.location} is over the size limit of {max_bytes} bytes")
    return buffer[:received]


def changed_during_import(file: SourceFile, how: str) -> FailedPrecondition:
    return FailedPrecondition(f"{file.location} changed during the import ({how}): import it again")


def present(names: Iterable[str]) -> list[str]:
    """The ``IMPORTED_FILES`` among ``names``, in upload order."""
    names = set(names)
    return [name for name in IMPORTED_FILES if name in names]
