"""The blob tier a store is configured with (``--blob-store``)."""

from __future__ import annotations

from pathlib import Path

from services.adapter_store.blobs.backend import BlobBackend
from services.adapter_store.blobs.local_directory import LocalDirectoryBlobs


def open_blob_backend(location: str, data_dir: Path, cache_bytes: int) -> BlobBackend:
    """``location``: "" (``data_dir``), a directory, or ``s3://bucket/prefix`` (behind a disk
    cache of ``cache_bytes`` in ``data_dir``)."""
    if location.startswith("s3://"):
        from services.adapter_store.blobs.disk_cache import DiskCachedBlobs
        from services.adapter_store.blobs.s3_bucket import S3Blobs

        return DiskCachedBlobs(S3Blobs(location), Path(data_dir) / "blob_cache", cache_bytes)
    if "://" in location and not location.startswith("file://"):
        raise ValueError(
            f"--blob-store {location!r}: expected a directory, file:///path or s3://bucket/prefix"
        )
    return LocalDirectoryBlobs(Path(location.removeprefix("file://") or data_dir))
