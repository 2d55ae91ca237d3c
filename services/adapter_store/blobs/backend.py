"""The one interface every place adapter bytes can live behind: content-addressed, write-once.

A blob is named by the sha256 of its bytes (lower-case hex), so two adapters with the same
weights (or the same config, or the same chat template) share one blob, and every cache in
front of a backend is keyed by content: a cached copy can never be stale. A blob is written once
and never changed; it disappears only when the collector (:mod:`..blob_collector`) removes one
that no catalog row references.

Writing has two steps so that the slow part can start before validation is done:
:meth:`BlobBackend.stage` begins a durable write of bytes under no name, and
:meth:`StagedBlob.publish` names it or :meth:`StagedBlob.discard` drops it. A name is visible
at once and durable once :meth:`BlobBackend.flush` returns: the store flushes once for every
registration committing together, just before their catalog rows commit. A crash between the
steps leaves only staging debris, which :meth:`BlobBackend.collect_staging` removes once it is
older than any write in flight could be.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class BlobMissing(Exception):
    """No blob has this digest."""


@dataclass(frozen=True)
class BlobEntry:
    """One blob as a listing shows it."""

    digest: str
    """sha256 of its bytes, lower-case hex: its name."""
    size: int
    """Its length in bytes."""
    modified_s: float
    """When it was last written (Unix seconds): the collector leaves young blobs alone."""


class StagedBlob(Protocol):
    """Bytes on their way to becoming a blob."""

    def publish(self, digest: str) -> None:
        """Make the bytes blob ``digest`` (their sha256, which the caller computed): visible on
        return, durable after the next :meth:`BlobBackend.flush`. A blob of that digest already
        there is kept: it holds the same bytes."""

    def discard(self) -> None:
        """Drop the bytes; nothing becomes visible."""


class BlobBackend(Protocol):
    """Where blobs are kept: a local directory, an S3 bucket, a cache in front of one."""

    description: str
    """Where, for ``loramesh status`` and the logs: ``file:///path`` or ``s3://bucket/prefix``."""

    def stage(self, data) -> StagedBlob:
        """Start writing ``data`` (bytes-like; it must not change until published or
        discarded). May return before the write is done."""

    def put(self, digest: str, data) -> None:
        """:meth:`stage` then :meth:`StagedBlob.publish`."""

    def flush(self) -> None:
        """Make every blob published so far durable (nothing to do where a publish is durable
        when it returns)."""

    def get(self, digest: str) -> memoryview:
        """The blob's bytes (read-only); :class:`BlobMissing` when there is none. The caller
        checks them against ``digest`` before trusting them."""

    def exists(self, digest: str) -> bool: ...

    def file_path(self, digest: str) -> Path | None:
        """The blob as a file of its own that a process sharing this machine's file system can
        read, where the backend keeps it so; None otherwise (or when there is no such blob)."""

    def delete(self, digest: str) -> None:
        """Remove the blob (nothing when it is not there)."""

    def listing(self) -> Iterator[BlobEntry]:
        """Every blob, in no particular order."""

    def collect_staging(self, older_than_s: float, now_s: float) -> int:
        """Remove staged writes abandoned by a crash (begun before ``now_s - older_than_s``);
        returns how many."""

    def close(self) -> None:
        """Finish the writes begun; release threads and connections."""
