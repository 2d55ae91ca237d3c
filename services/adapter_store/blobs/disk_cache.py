"""A local-disk copy of a remote backend's blobs (S3's), so that loading an adapter again after
the store's RAM tier let it go, or after a restart, reads a local file instead of the network.

Blobs are content-addressed and write-once, so a cached copy can never be stale: the cache
needs no invalidation, only a budget. Past ``budget_bytes`` the least recently read files are
removed. A file is written under a temporary name and renamed to its digest, so a crash leaves
no half file under a digest's name; it is not flushed (``fsync``), because every read checks the
bytes against the digest anyway: a file the disk lost or corrupted is removed and read from the
backend again. Temporary files left by a crash are removed when the cache opens: a cache
directory belongs to one store process.

Writes go straight to the backend (the blob must be durable there; a fresh upload is in the RAM
tier already) and so do listings: the backend is the truth, the cache only a copy of some of it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

from services.adapter_store.blobs.backend import BlobBackend, BlobEntry, StagedBlob
from services.runtime.process.mapped_memory import populated_mapping
from services.runtime.security.private_files import PRIVATE_FILE_MODE, private_dir

log = logging.getLogger("loramesh.adapter_store")

_TEMPORARY = ".part"
_DIGEST_LENGTH = 64
"""A sha256 in hex: what a cache file's name is; anything else in the directory is not ours."""


def _read_file(path: Path) -> memoryview:
    """The file's bytes in an anonymous mapping (off the Python heap, like a backend's)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mapping = memoryview(populated_mapping(size))
        f.readinto(mapping)
    return mapping[:size]


class DiskCachedBlobs:
    """``backend``'s blobs, read through a cache of at most ``budget_bytes`` in ``cache_dir``."""

    def __init__(
        self, backend: BlobBackend, cache_dir: Path, budget_bytes: int, clock: Callable[[], float] = time.time
    ):
        """``clock``: Unix seconds, stamped on a file when it is cached or read (its recency for
        the next run's index; injected by tests)."""
        self.backend = backend
        self._clock = clock
        self.cache_dir = private_dir(cache_dir)
        self.budget_bytes = budget_bytes
        self.description = f"{backend.description} (disk cache {self.cache_dir})"
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()
        """The cached files' sizes, least recently read first."""
        self._used = 0
        self._index()

    def _index(self) -> None:
        """Take in the files a previous run left, oldest read first (a hit touches the file),
        and remove its temporary ones."""
        found = []
        for entry in os.scandir(self.cache_dir):
            if entry.name.endswith(_TEMPORARY):
                os.unlink(entry.path)
            elif len(entry.name) == _DIGEST_LENGTH and entry.is_file():
                stat = entry.stat()
                found.append((stat.st_mtime, entry.name, stat.st_size))
        with self._lock:
            for _, digest, size in sorted(found):
                self._sizes[digest] = size
                self._used += size
            self._evict()

    def _path(self, digest: str) -> Path:
        return self.cache_dir / digest

    def flush(self) -> None:
        self.backend.flush()

    def get(self, digest: str) -> memoryview:
        with self._lock:
            cached = digest in self._sizes
            if cached:
                self._sizes.move_to_end(digest)
        if cached:
            data = self._read_cached(digest)
            if data is not None:
                return data
        data = self.backend.get(digest)
        self._keep(digest, data)
        return data

    def _read_cached(self, digest: str) -> memoryview | None:
        """The cached copy when it is whole; None when it is gone (evicted meanwhile) or
        corrupt (then removed)."""
        path = self._path(digest)
        try:
            data = _read_file(path)
            self._stamp(path)
        except FileNotFoundError:  # evicted or deleted meanwhile
            self._forget(digest)
            return None
        if hashlib.sha256(data).hexdigest() == digest:
            return data
        log.warning("cached blob %s is corrupt: removed, read from %s again", path, self.backend.description)
        self._forget(digest)
        return None

    def _keep(self, digest: str, data: memoryview) -> None:
        """Cache ``data`` (unless it alone is over the budget), evicting the least recently
        read files beyond the budget. A cache that cannot write (a full disk) only logs: the
        read has its bytes from the backend."""
        if len(data) > self.budget_bytes:
            return
        temporary = self.cache_dir / f"{digest}.{uuid.uuid4().hex}{_TEMPORARY}"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
            with open(fd, "wb") as f:
                f.write(data)
            with self._lock:
                os.replace(temporary, self._path(digest))
                self._stamp(self._path(digest))
                self._used += len(data) - self._sizes.pop(digest, 0)
                self._sizes[digest] = len(data)
                self._evict()
        except OSError as error:
            log.warning("blob %s not cached in %s: %s", digest, self.cache_dir, error)
        finally:
            temporary.unlink(missing_ok=True)

    def _stamp(self, path: Path) -> None:
        """Record ``path``'s recency, for the next run's index."""
        now = self._clock()
        os.utime(path, (now, now))

    def _evict(self) -> None:
        """Remove the least recently read files until the cache is within its budget (the lock
        held)."""
        while self._used > self.budget_bytes:
            digest, size = self._sizes.popitem(last=False)
            self._used -= size
            self._path(digest).unlink(missing_ok=True)

    def _forget(self, digest: str) -> None:
        with self._lock:
            self._used -= self._sizes.pop(digest, 0)
            self._path(digest).unlink(missing_ok=True)

    def stage(self, data) -> StagedBlob:
        return self.backend.stage(data)

    def put(self, digest: str, data) -> None:
        self.backend.put(digest, data)

    def file_path(self, digest: str) -> Path | None:
        """None: a cached file can be evicted while another process reads it."""
        return None

    def exists(self, digest: str) -> bool:
        return self.backend.exists(digest)

    def delete(self, digest: str) -> None:
        self.backend.delete(digest)
        self._forget(digest)

    def listing(self) -> Iterator[BlobEntry]:
        return self.backend.listing()

    def collect_staging(self, older_than_s: float, now_s: float) -> int:
        return self.backend.collect_staging(older_than_s, now_s)

    def close(self) -> None:
        self.backend.close()
