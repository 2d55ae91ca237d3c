"""Page-aligned memory for uploads and imports, so a blob can be written from it with
``O_DIRECT`` (whole pages from page-aligned memory) without another copy."""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Sequence

import numpy as np

from services.runtime.process.mapped_memory import PAGE, pages, populated_mapping


def address(data) -> int:
    return np.frombuffer(data, dtype=np.uint8).ctypes.data


_PADDED_BLOCKS: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
"""The blocks :func:`page_aligned_empty` made, by id: the memory after a view of one, up to
its last page's end, is nobody else's, so the view is written as whole pages from it."""


_JOINED_MAPPINGS: weakref.WeakValueDictionary[int, mmap.mmap] = weakref.WeakValueDictionary()
"""The mappings :func:`page_aligned_join` made, by id: the rest of a view's last page is theirs."""


def page_aligned_empty(size: int) -> memoryview:
    """``size`` writable bytes (uninitialised) that start on a page boundary and are followed by
    the rest of their last page, so that a local-directory blob write sends them (or any prefix
    of them) to the disk as whole pages in one write, without another copy. The memory comes
    from the heap, where a store that retains freed memory reuses it without page faults
    (:mod:`services.runtime.process.allocator`)."""
    block = np.empty(pages(size) + PAGE, dtype=np.uint8)
    _PADDED_BLOCKS[id(block)] = block
    start = -block.ctypes.data % PAGE
    return memoryview(block)[start : start + size]


def whole_pages(data: memoryview) -> memoryview | None:
    """``data`` and the rest of its last page, zeroed, when ``data`` is a page-aligned view of
    a :func:`page_aligned_empty` block, or the start of a mapping that holds its last page
    (:func:`page_aligned_join`'s ``mapped``); else None."""
    if isinstance(data.obj, mmap.mmap):
        return _mapped_whole_pages(data)
    block = _PADDED_BLOCKS.get(id(data.obj))
    if block is not data.obj or not data.contiguous:
        return None
    start = address(data)
    offset = start - block.ctypes.data
    whole = memoryview(block)[offset : offset + pages(len(data))]
    if start % PAGE or len(whole) != pages(len(data)):
        return None
    whole[len(data) :] = bytes(len(whole) - len(data))
    return whole


def _mapped_whole_pages(data: memoryview) -> memoryview | None:
    mapping = data.obj
    if _JOINED_MAPPINGS.get(id(mapping)) is not mapping or not data.contiguous:
        return None
    if len(mapping) < pages(len(data)) or address(data) != address(mapping):
        return None
    whole = memoryview(mapping)[: pages(len(data))]
    whole[len(data) :] = bytes(len(whole) - len(data))
    return whole


def page_aligned_join(parts: Sequence, mapped: bool = False) -> memoryview:
    """``parts`` (bytes-like) joined into :func:`page_aligned_empty` memory, or with ``mapped``
    into a fresh anonymous mapping (whole pages), which the RAM tier keeps as it is: for a
    publish, whose weights go into the RAM tier, one copy of the upload instead of two."""
    size = sum(len(part) for part in parts)
    if mapped:
        mapping = populated_mapping(pages(size))
        _JOINED_MAPPINGS[id(mapping)] = mapping
        joined = memoryview(mapping)[:size]
    else:
        joined = page_aligned_empty(size)
    position = 0
    for part in parts:
        joined[position : position + len(part)] = part
        position += len(part)
    return joined
