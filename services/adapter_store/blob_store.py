"""Adapter weight files on disk, written so that nothing half-written is ever visible.

A blob is written to ``tmp/`` first, fsynced, then renamed into ``blobs/`` and the directory
fsynced: after a crash a blob either exists whole under its final name or not at all. Leftover
temp files are removed on start.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import uuid
from pathlib import Path

from services.runtime.private_files import private_dir


def sha256_hex(data) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BlobStore:
    """One file per adapter id under ``root/blobs``."""

    SUFFIX = ".safetensors"

    def __init__(self, root: Path):
        self.blob_dir = root / "blobs"
        self.tmp_dir = root / "tmp"
        for directory in (root, self.blob_dir, self.tmp_dir):
            private_dir(directory)

    def path(self, blob_id: str) -> Path:
        return self.blob_dir / f"{blob_id}{self.SUFFIX}"

    def write(self, blob_id: str, data: bytes) -> Path:
        """Durably store ``data`` as ``blob_id``: temp file, fsync, rename, fsync directory."""
        tmp = self.tmp_dir / f"{blob_id}.{uuid.uuid4().hex[:8]}.part"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            final = self.path(blob_id)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(self.blob_dir)
        return final

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

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.blob_dir.glob(f"*{self.SUFFIX}"))
