"""Blobs on disk hold exactly the bytes given, whichever way they reach the disk: whole pages
straight from an upload joined in page-aligned memory, or through the writing thread's buffer."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from services.adapter_store import blob_store
from services.adapter_store.blob_store import BlobStore, page_aligned_join

PAGE = mmap.PAGESIZE
SIZES = [1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 17, blob_store.BOUNCE_BYTES + PAGE + 5]


def payload(size: int) -> bytes:
    return np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()


def test_a_join_lands_on_a_page_and_holds_the_parts_in_order():
    parts = [payload(1000), b"", payload(PAGE * 2 + 3), memoryview(payload(77))[5:]]
    joined = page_aligned_join(parts)
    assert np.frombuffer(joined, dtype=np.uint8).ctypes.data % PAGE == 0
    assert bytes(joined) == b"".join(bytes(part) for part in parts)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("aligned", [True, False], ids=["page-aligned upload", "other bytes"])
def test_a_blob_holds_exactly_its_bytes(tmp_path, size, aligned):
    data = payload(size)
    blobs = BlobStore(tmp_path)
    blobs.write("a", page_aligned_join([data]) if aligned else data)
    assert blobs.path("a").read_bytes() == data
    assert bytes(blobs.read("a")) == data
    assert os.listdir(blobs.tmp_dir) == []


def test_whole_pages_of_an_aligned_upload_skip_the_bounce_buffer(tmp_path, monkeypatch):
    """Only the last, partial page goes through the buffer (on a file system that takes O_DIRECT)."""
    blobs = BlobStore(tmp_path)
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

    monkeypatch.setattr(blobs, "_buffer", CountingBuffer)
    data = payload(3 * PAGE + 17)
    blobs.write("a", page_aligned_join([data]))
    if not blobs._direct:
        pytest.skip(f"{tmp_path} refuses O_DIRECT: blobs go through the page cache")
    assert copied[0] == 17
    assert blobs.path("a").read_bytes() == data
