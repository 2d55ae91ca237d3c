"""What the adapter store's collector does once its grace period is over, run at once."""

from __future__ import annotations

import time

from services.adapter_store.blob_collector import BlobCollector


def collect_unreferenced_blobs(repository) -> int:
    """Remove every blob no row references, however young; returns how many."""
    return BlobCollector(
        repository.catalog, repository.blobs, grace_s=0, clock=lambda: time.time() + 1
    ).collect()
