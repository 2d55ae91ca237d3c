"""Blobs on disk hold exactly the bytes given, whichever way they reach the disk: whole pages in
one write from memory the store allocated for them (an upload joined, an import read), or
through the writing thread's buffer."""

from __future__ import annotations

import errno
import mmap
import os

import numpy as np
import pytest

from services.adapter_store.blobs import local_directory
from services.adapter_store.blobs.backend import BlobMissing
from services.adapter_store.blobs.local_directory import LocalDirectoryBlobs
from services.adapter_store.blobs.page_aligned import page_aligned_empty, page_aligned_join

PAGE = mmap.PAGESIZE
SIZES = [1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 17, local_directory.BOUNCE_BYTES + PAGE + 5]


def payload(size: int) -> bytes:
    return np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("mapped", [False, True])
def test_a_join_lands_on_a_page_and_holds_the_parts_in_order(mapped):
    parts = [payload(1000), b"", payload(PAGE * 2 + 3), memoryview(payload(77))[5:]]
    joined = page_aligned_join(parts, mapped=mapped)
    assert np.frombuffer(joined, dtype=np.uint8).ctypes.data % PAGE == 0
    assert bytes(joined) == b"".join(bytes(part) for part in parts)


def in_store_memory(data: bytes) -> memoryview:
    """``data`` as an import reads it: a prefix of a larger page_aligned_empty block, whose
    bytes after it are not zero."""
    block = page_aligned_empty(len(data) + 2 * PAGE + 1)
    block[:] = b"\xff" * len(block)
    block[: len(data)] = data
    return block[: len(data)]


def in_a_mapping(data: bytes) -> memoryview:
    """Page-aligned memory the store did not allocate: what follows it is not the store's."""
    mapping = mmap.mmap(-1, len(data))
    mapping[:] = data
    return memoryview(mapping)


MEMORY = {
    "upload joined": lambda data: page_aligned_join([data]),
    "publish joined": lambda data: page_aligned_join([data], mapped=True),
    "import read": in_store_memory,
    "page-aligned mapping": in_a_mapping,
    "other bytes": bytes,
}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("memory", MEMORY)
def test_a_blob_holds_exactly_its_bytes(tmp_path, size, memory):
    data = payload(size)
    blobs = LocalDirectoryBlobs(tmp_path)
    blobs.put("a", MEMORY[memory](data))
    assert blobs.path("a").read_bytes() == data
    assert bytes(blobs.get("a")) == data
    assert os.listdir(blobs.staging_dir) == []


@pytest.mark.parametrize(
    ("memory", "writes", "through_buffer"),
    [
        ("upload joined", 1, []),
        ("publish joined", 1, []),
        ("import read", 1, []),
        ("page-aligned mapping", 2, [17, PAGE - 17]),
    ],
)
def test_only_memory_the_store_allocated_is_written_whole_in_one_go(
    tmp_path, monkeypatch, memory, writes, through_buffer
):
    """The store's own blocks are written as whole pages from their memory (the last page
    completed with zeros from the block); other aligned memory sends its whole pages straight
    and its last, partial page through the buffer: its 17 bytes, then zeros (on a file system
    that takes O_DIRECT)."""
    blobs = LocalDirectoryBlobs(tmp_path)
    copied: list[int] = []
    buffer = blobs._buffer()

    class CountingBuffer:
        def __len__(self):
            return len(buffer)

        def __setitem__(self, key, value):
            copied.append(len(value))
            buffer[key] = value

        def __getitem__(self, key):
            return buffer[key]

    sizes: list[int] = []
    write = os.write

    def counting_write(fd, view):
        sizes.append(len(view))
        return write(fd, view)

    monkeypatch.setattr(blobs, "_buffer", CountingBuffer)
    monkeypatch.setattr(local_directory.os, "write", counting_write)
    data = payload(3 * PAGE + 17)
    blobs.put("a", MEMORY[memory](data))
    assert blobs.path("a").read_bytes() == data
    if not blobs._direct:
        pytest.skip(f"{tmp_path} refuses O_DIRECT: blobs go through the page cache")
    assert (len(sizes), copied) == (writes, through_buffer)
    assert all(size % PAGE == 0 for size in sizes)


def test_a_blob_is_named_by_its_digest_written_once_and_listed(tmp_path):
    blobs = LocalDirectoryBlobs(tmp_path)
    blobs.put("d1", b"one")
    blobs.stage(b"one").publish("d1")  # the same content again: the blob stands as it was
    staged = blobs.stage(b"two")
    staged.discard()
    assert [(e.digest, e.size) for e in blobs.listing()] == [("d1", 3)]
    assert blobs.exists("d1") and not blobs.exists("d2")
    with pytest.raises(BlobMissing):
        blobs.get("d2")
    blobs.delete("d1")
    assert list(blobs.listing()) == [] and os.listdir(blobs.staging_dir) == []


def test_staged_files_are_collected_only_once_old(tmp_path):
    """Replicas share the directory: a young staged file may be another replica's write."""
    blobs = LocalDirectoryBlobs(tmp_path)
    (blobs.staging_dir / "x.part").write_bytes(b"half")
    now = os.stat(blobs.staging_dir / "x.part").st_mtime
    assert blobs.collect_staging(older_than_s=60, now_s=now + 30) == 0
    assert blobs.collect_staging(older_than_s=60, now_s=now + 90) == 1
    assert os.listdir(blobs.staging_dir) == []


@pytest.mark.parametrize("size", [0, PAGE - 1, 3 * PAGE + 17])
def test_a_file_system_that_refuses_direct_reads_is_read_through_the_page_cache(tmp_path, monkeypatch, size):
    data = payload(size)
    blobs = LocalDirectoryBlobs(tmp_path)
    blobs.put("a", page_aligned_join([data]))
    opened = os.open
    direct_tries: list[int] = []

    def refusing_direct(path, flags, *mode):
        if flags & getattr(os, "O_DIRECT", 0):
            direct_tries.append(flags)
            raise OSError(errno.EINVAL, "no O_DIRECT here")
        return opened(path, flags, *mode)

    monkeypatch.setattr(local_directory.os, "open", refusing_direct)
    assert bytes(blobs.get("a")) == data
    assert len(direct_tries) == (1 if blobs._direct else 0)
