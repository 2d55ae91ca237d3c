"""Adapter weight files on disk, written so that nothing half-written is ever visible.

A blob is written to ``tmp/`` first, made durable (``fdatasync``), then renamed into ``blobs/``;
the rename itself is durable once :meth:`BlobStore.sync_dir` has run, which the repository does
once for a whole group of registrations before their catalog rows commit. After a crash a blob
either exists whole under its final name or not at all. Leftover temp files are removed on start.

Writes bypass the page cache (``O_DIRECT``): copying every byte into freshly allocated
page-cache pages cost more CPU than hashing them (issue 30: registration was bound by requests,
not bytes). ``O_DIRECT`` takes whole pages from page-aligned memory: an upload is assembled in
such memory (:func:`page_aligned_join`), an import is read into it (:func:`page_aligned_empty`),
and either is written from it in one write; anything else goes through a small aligned buffer
each writing thread keeps. A file system that refuses ``O_DIRECT`` is written through the page
cache instead, with the same durability.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import mmap
import os
import threading
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from services.runtime.security.private_files import PRIVATE_FILE_MODE, private_dir

log = logging.getLogger("loramesh.adapter_store")

_PAGE = mmap.PAGESIZE
_O_DIRECT = getattr(os, "O_DIRECT", 0)
BOUNCE_BYTES = 4 << 20
"""Size of each writing thread's aligned buffer: a blob is written this much at a time."""


def sha256_hex(data) -> str:
    return hashlib.sha256(data).hexdigest()


def _pages(size: int) -> int:
    return -(-size // _PAGE) * _PAGE


def _address(data) -> int:
    return np.frombuffer(data, dtype=np.uint8).ctypes.data


_PADDED_BLOCKS: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
"""The blocks :func:`page_aligned_empty` made, by id: the memory after a view of one, up to
its last page's end, is nobody else's, so the view is written as whole pages from it."""


def page_aligned_empty(size: int) -> memoryview:
    """``size`` writable bytes (uninitialised) that start on a page boundary and are followed by
    the rest of their last page, so that :meth:`BlobStore.write` sends them (or any prefix of
    them) to the disk as whole pages in one write, without another copy. The memory comes from
    the heap, where a store that retains freed memory reuses it without page faults
    (:mod:`services.runtime.process.allocator`)."""
    block = np.empty(_pages(size) + _PAGE, dtype=np.uint8)
    _PADDED_BLOCKS[id(block)] = block
    start = -block.ctypes.data % _PAGE
    return memoryview(block)[start : start + size]


def _whole_pages(data: memoryview) -> memoryview | None:
    """``data`` and the rest of its last page, zeroed, when ``data`` is a page-aligned view of
    a :func:`page_aligned_empty` block; else None."""
    block = _PADDED_BLOCKS.get(id(data.obj))
    if block is not data.obj or not data.contiguous:
        return None
    address = _address(data)
    offset = address - block.ctypes.data
    whole = memoryview(block)[offset : offset + _pages(len(data))]
    if address % _PAGE or len(whole) != _pages(len(data)):
        return None
    whole[len(data) :] = bytes(len(whole) - len(data))
    return whole


def page_aligned_join(parts: Sequence) -> memoryview:
    """``parts`` (bytes-like) joined into :func:`page_aligned_empty` memory."""
    joined = page_aligned_empty(sum(len(part) for part in parts))
    position = 0
    for part in parts:
        joined[position : position + len(part)] = part
        position += len(part)
    return joined


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview) -> None:
    written = 0
    while written < len(view):
        written += os.write(fd, view[written:])


class BlobStore:
    """One file per adapter id under ``root/blobs``."""

    SUFFIX = ".safetensors"

    def __init__(self, root: Path):
        self.blob_dir = root / "blobs"
        self.tmp_dir = root / "tmp"
        for directory in (root, self.blob_dir, self.tmp_dir):
            private_dir(directory)
        self._direct = bool(_O_DIRECT)
        self._buffers = threading.local()

    def path(self, blob_id: str) -> Path:
        return self.blob_dir / f"{blob_id}{self.SUFFIX}"

    def write(self, blob_id: str, data) -> None:
        """Store ``data`` as ``blob_id``: :meth:`write_temp`, then :meth:`publish`."""
        self.publish(self.write_temp(data), blob_id)

    def write_temp(self, data) -> Path:
        """``data`` in a new file under ``tmp/``, ``fdatasync``'d: no blob until
        :meth:`publish` names it one (a crash leaves it to :meth:`clean_temp`)."""
        tmp = self.tmp_dir / f"{uuid.uuid4().hex}.part"
        try:
            self._write_file(tmp, memoryview(data))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def publish(self, temp: Path, blob_id: str) -> None:
        """Rename ``temp`` (from :meth:`write_temp`) to blob ``blob_id``; durable once
        :meth:`sync_dir` has run after it."""
        try:
            os.replace(temp, self.path(blob_id))
        finally:
            temp.unlink(missing_ok=True)

    def _write_file(self, path: Path, data: memoryview) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        if self._direct:
            try:
                fd = os.open(path, flags | _O_DIRECT, PRIVATE_FILE_MODE)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                log.warning("%s refuses O_DIRECT: blobs are written through the page cache", path.parent)
                self._direct = False
            else:
                try:
                    self._write_direct(fd, data)
                finally:
                    os.close(fd)
                return
        fd = os.open(path, flags, PRIVATE_FILE_MODE)
        try:
            _write_all(fd, data)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def _write_direct(self, fd: int, data: memoryview) -> None:
        """Whole pages (``O_DIRECT``'s rule), the last padded with zeros, then the file cut to
        ``data``'s size: in one write from ``data``'s own memory when :func:`page_aligned_empty`
        made it, else through :meth:`_write_through_buffer`."""
        whole = _whole_pages(data)
        if whole is not None:
            _write_all(fd, whole)
        else:
            self._write_through_buffer(fd, data)
        if len(data) % _PAGE:
            os.ftruncate(fd, len(data))
        os.fdatasync(fd)

    def _write_through_buffer(self, fd: int, data: memoryview) -> None:
        """Straight from ``data`` as far as its whole pages go when it starts on a page, the rest
        through this thread's aligned buffer."""
        buffer = self._buffer()
        first = 0
        if _address(data) % _PAGE == 0:
            first = len(data) // _PAGE * _PAGE
            _write_all(fd, data[:first])
        for start in range(first, len(data), len(buffer)):
            part = data[start : start + len(buffer)]
            size, padded = len(part), _pages(len(part))
            buffer[:size] = part
            buffer[size:padded] = bytes(padded - size)
            _write_all(fd, buffer[:padded])

    def _buffer(self) -> memoryview:
        """This thread's aligned buffer (a mapping starts on a page)."""
        buffer = getattr(self._buffers, "view", None)
        if buffer is None:
            buffer = self._buffers.view = memoryview(mmap.mmap(-1, BOUNCE_BYTES))
        return buffer

    def sync_dir(self) -> None:
        """Make the renames of every blob written so far durable."""
        _fsync_dir(self.blob_dir)

    def read(self, blob_id: str) -> memoryview:
        """The blob's bytes in an anonymous mapping (off the Python heap, see ``ram_tier``)."""
        with open(self.path(blob_id), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mapping = mmap.mmap(-1, max(size, 1))
            f.readinto(mapping)
        return memoryview(mapping)[:size]

    def delete(self, blob_id: str) -> None:
        self.path(blob_id).unlink(missing_ok=True)

    def ids(self) -> set[str]:
        return {p.name[: -len(self.SUFFIX)] for p in self.blob_dir.glob(f"*{self.SUFFIX}")}

    def clean_temp(self) -> int:
        """Remove uploads interrupted by a crash; returns how many were removed."""
        leftovers = list(self.tmp_dir.iterdir())
        for path in leftovers:
            path.unlink(missing_ok=True)
        return len(leftovers)
