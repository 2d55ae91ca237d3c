"""The one read every importer uses: the listed size and the store's limit bound it, and the
bytes land in page-aligned memory that the blob store writes without copying."""

from __future__ import annotations

import io
import mmap

import numpy as np
import pytest

from services.adapter_store.blobs.page_aligned import whole_pages
from services.adapter_store.importers.source import SourceFile, read_capped
from services.runtime.errors import ResourceExhausted

PAGE = mmap.PAGESIZE


def listed(size: int) -> SourceFile:
    return SourceFile("adapter_model.safetensors", "file:///adapters/a/adapter_model.safetensors", size, "v1")


@pytest.mark.parametrize("size", [0, 1, PAGE, 3 * PAGE + 5])
def test_the_listed_bytes_are_read_whole_into_page_aligned_memory(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    read = read_capped(io.BytesIO(data), listed(size), max_bytes=1 << 20)
    assert bytes(read) == data
    assert np.frombuffer(read, dtype=np.uint8).ctypes.data % PAGE == 0 or size == 0
    assert whole_pages(read) is not None, "the blob store writes it without another copy"


def test_a_file_that_grew_since_its_listing_reads_one_byte_more_and_no_further():
    read = read_capped(io.BytesIO(b"x" * 10_000), listed(100), max_bytes=1 << 20)
    assert len(read) == 101  # fetch_adapter_files refuses it as changed during the import


def test_a_stream_past_the_limit_is_refused_naming_the_file():
    with pytest.raises(
        ResourceExhausted, match=r"file:///adapters/a/adapter_model.safetensors .* limit of 100"
    ):
        read_capped(io.BytesIO(b"x" * 10_000), listed(100), max_bytes=100)


def test_a_short_stream_reads_what_there_is():
    assert bytes(read_capped(io.BytesIO(b"abc"), listed(100), max_bytes=1 << 20)) == b"abc"
