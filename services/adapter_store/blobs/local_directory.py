"""Blobs as files in one directory: the embedded default (``loramesh up`` on one machine, and
several store replicas on one host sharing the directory).

A blob is written to ``staging/`` first, made durable (``fdatasync``), then renamed to
``sha256/<sha256>``; the rename is durable once the directory is flushed (:meth:`flush`: the
store flushes once for every registration committing together). After a crash
a blob exists whole under its name or not at all; what is left in ``staging/`` is removed by
:meth:`LocalDirectoryBlobs.collect_staging` once it is older than any write in flight. Each
staged file has a name of its own, so replicas sharing the directory never touch each other's.

Writes bypass the page cache (``O_DIRECT``): copying every byte into freshly allocated
page-cache pages cost more CPU than hashing them (issue 30: registration was bound by requests,
not bytes). ``O_DIRECT`` takes whole pages from page-aligned memory: an upload is assembled in
such memory (:func:`.page_aligned.page_aligned_join`), an import is read into it
(:func:`.page_aligned.page_aligned_empty`), and either is written from it in one write; anything
else goes through a small aligned buffer each writing thread keeps. A file system that refuses
``O_DIRECT`` is written through the page cache instead, with the same durability. Reads bypass
it too (a blob is read when the RAM tier does not hold it, and it never sat in the page cache).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from services.adapter_store.blobs.backend import BlobEntry, BlobMissing
from services.adapter_store.blobs.page_aligned import PAGE, address, pages, whole_pages
from services.runtime.process.mapped_memory import read_file_mapped
from services.runtime.security.private_files import PRIVATE_FILE_MODE, private_dir

log = logging.getLogger("loramesh.adapter_store")

_O_DIRECT = getattr(os, "O_DIRECT", 0)
BOUNCE_BYTES = 4 << 20
"""Size of each writing thread's aligned buffer: a blob is written this much at a time."""
INLINE_STAGE_BYTES = 1 << 20
"""Blobs up to this size are staged on the calling thread: handing a small write to a writer
thread and its result back cost more CPU (two thread switches) than overlapping it with the
validation saved."""


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


@dataclass(frozen=True)
class _StagedFile:
    """Bytes being written to a file under ``staging/`` on a writer thread."""

    blobs: LocalDirectoryBlobs
    written: Future[Path]
    """The staged file, once written and flushed (or the write's error)."""

    def publish(self, digest: str) -> None:
        self.blobs.publish(self.written.result(), digest)

    def discard(self) -> None:
        with contextlib.suppress(Exception):
            self.written.result().unlink(missing_ok=True)


class LocalDirectoryBlobs:
    """One file per blob under ``root/sha256``, named by its sha256."""

    def __init__(self, root: Path, max_writers: int = 8):
        """``max_writers``: staged writes at a time (each a disk wait, not CPU)."""
        self.root = Path(root)
        self.blob_dir = self.root / "sha256"
        self.staging_dir = self.root / "staging"
        for directory in (self.root, self.blob_dir, self.staging_dir):
            private_dir(directory)
        self.description = self.root.resolve().as_uri()
        self._direct = bool(_O_DIRECT)
        self._buffers = threading.local()
        self._writers = ThreadPoolExecutor(max_workers=max_writers, thread_name_prefix="blob-write")

    def path(self, digest: str) -> Path:
        return self.blob_dir / digest

    def stage(self, data) -> _StagedFile:
        if memoryview(data).nbytes > INLINE_STAGE_BYTES:
            return _StagedFile(self, self._writers.submit(self.write_staged, data))
        written: Future[Path] = Future()
        try:
            written.set_result(self.write_staged(data))
        except Exception as error:  # noqa: BLE001 - raised where a writer thread's would be: at publish
            written.set_exception(error)
        return _StagedFile(self, written)

    def put(self, digest: str, data) -> None:
        self.publish(self.write_staged(data), digest)

    def write_staged(self, data) -> Path:
        """``data`` in a new file under ``staging/``, ``fdatasync``'d."""
        staged = self.staging_dir / f"{uuid.uuid4().hex}.part"
        try:
            self._write_file(staged, memoryview(data))
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
        return staged

    def publish(self, staged: Path, digest: str) -> None:
        """Rename ``staged`` to blob ``digest`` (durable after :meth:`flush`). Renaming over an
        existing blob of the same digest replaces bytes with the same bytes."""
        try:
            os.replace(staged, self.path(digest))
        finally:
            staged.unlink(missing_ok=True)

    def flush(self) -> None:
        """Make every rename into ``sha256/`` so far durable."""
        _fsync_dir(self.blob_dir)

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
        ``data``'s size: in one write from ``data``'s own memory when it is page-aligned memory
        the store allocated, else through :meth:`_write_through_buffer`."""
        whole = whole_pages(data)
        if whole is not None:
            _write_all(fd, whole)
        else:
            self._write_through_buffer(fd, data)
        if len(data) % PAGE:
            os.ftruncate(fd, len(data))
        os.fdatasync(fd)

    def _write_through_buffer(self, fd: int, data: memoryview) -> None:
        """Straight from ``data`` as far as its whole pages go when it starts on a page, the rest
        through this thread's aligned buffer."""
        buffer = self._buffer()
        first = 0
        if address(data) % PAGE == 0:
            first = len(data) // PAGE * PAGE
            _write_all(fd, data[:first])
        for start in range(first, len(data), len(buffer)):
            part = data[start : start + len(buffer)]
            size, padded = len(part), pages(len(part))
            buffer[:size] = part
            buffer[size:padded] = bytes(padded - size)
            _write_all(fd, buffer[:padded])

    def _buffer(self) -> memoryview:
        """This thread's aligned buffer (a mapping starts on a page)."""
        buffer = getattr(self._buffers, "view", None)
        if buffer is None:
            buffer = self._buffers.view = memoryview(mmap.mmap(-1, BOUNCE_BYTES))
        return buffer

    def get(self, digest: str) -> memoryview:
        """The blob's bytes in an anonymous mapping (off the Python heap, see ``ram_tier``), read
        past the page cache as they were written (one copy fewer: 4.5 against 6.8 ms of CPU for
        10 MB), unless the file system refuses ``O_DIRECT``."""
        try:
            return read_file_mapped(self.path(digest), self._direct)
        except FileNotFoundError:
            raise BlobMissing(digest) from None

    def exists(self, digest: str) -> bool:
        return self.path(digest).exists()

    def file_path(self, digest: str) -> Path | None:
        path = self.path(digest)
        return path if path.exists() else None

    def delete(self, digest: str) -> None:
        self.path(digest).unlink(missing_ok=True)

    def listing(self) -> Iterator[BlobEntry]:
        for entry in os.scandir(self.blob_dir):
            with contextlib.suppress(FileNotFoundError):  # collected meanwhile
                stat = entry.stat()
                yield BlobEntry(entry.name, stat.st_size, stat.st_mtime)

    def collect_staging(self, older_than_s: float, now_s: float) -> int:
        removed = 0
        for entry in os.scandir(self.staging_dir):
            with contextlib.suppress(FileNotFoundError):
                if entry.stat().st_mtime < now_s - older_than_s:
                    os.unlink(entry.path)
                    removed += 1
        return removed

    def close(self) -> None:
        self._writers.shutdown(wait=True)
