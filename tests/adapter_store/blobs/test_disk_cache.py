"""DiskCachedBlobs in front of S3Blobs on a real S3 API (moto's server over HTTP), with real
files: a read served from disk the second time, a corrupt copy healed, the budget kept by
evicting the least recently read, and the cache taken up again after a restart."""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.adapter_store.blobs.backend import BlobMissing
from services.adapter_store.blobs.disk_cache import DiskCachedBlobs
from services.adapter_store.blobs.s3_bucket import S3Blobs


class CountingGets:
    """A backend that counts the reads that reach it."""

    def __init__(self, backend: S3Blobs):
        self.backend = backend
        self.description = backend.description
        self.gets = 0

    def get(self, digest: str) -> memoryview:
        self.gets += 1
        return self.backend.get(digest)

    def __getattr__(self, name: str):
        return getattr(self.backend, name)


@pytest.fixture
def remote(bucket) -> CountingGets:
    return CountingGets(S3Blobs(f"s3://{bucket}/store"))


@pytest.fixture
def cache_dir(tmp_path):
    return tmp_path / "cache"


def cached_files(cache_dir) -> set[str]:
    return set(os.listdir(cache_dir))


def test_a_second_read_does_not_reach_the_backend(remote, cache_dir, blob):
    digest, data = blob(1, 1 << 20)
    cache = DiskCachedBlobs(remote, cache_dir, budget_bytes=8 << 20)
    cache.put(digest, data)
    assert cache.get(digest) == data
    assert cache.get(digest) == data
    assert remote.gets == 1
    assert cached_files(cache_dir) == {digest}
    assert cache.description == f"{remote.description} (disk cache {cache_dir})"


def test_an_empty_blob_is_cached_too(remote, cache_dir, blob):
    digest, data = blob(1, 0)
    cache = DiskCachedBlobs(remote, cache_dir, budget_bytes=1 << 20)
    cache.put(digest, data)
    assert cache.get(digest) == cache.get(digest) == b""
    assert remote.gets == 1


def test_a_corrupt_cached_copy_is_read_again_from_the_backend(remote, cache_dir, blob):
    digest, data = blob(1, 4096)
    cache = DiskCachedBlobs(remote, cache_dir, budget_bytes=1 << 20)
    cache.put(digest, data)
    cache.get(digest)
    (cache_dir / digest).write_bytes(b"\0" * 4096)
    assert cache.get(digest) == data
    assert remote.gets == 2
    assert (cache_dir / digest).read_bytes() == data
    assert cache.get(digest) == data
    assert remote.gets == 2


def test_the_budget_evicts_the_least_recently_read(remote, cache_dir, blob):
    a, b, c, d = (blob(seed, 1000) for seed in range(4))
    cache = DiskCachedBlobs(remote, cache_dir, budget_bytes=3000)
    for digest, data in (a, b, c, d):
        cache.put(digest, data)
    for digest, _ in (a, b, c, a):
        cache.get(digest)
    cache.get(d[0])
    assert cached_files(cache_dir) == {a[0], c[0], d[0]}
    gets = remote.gets
    assert cache.get(b[0]) == b[1]
    assert remote.gets == gets + 1
    assert cached_files(cache_dir) == {a[0], b[0], d[0]}


def test_a_blob_over_the_budget_is_not_cached(remote, cache_dir, blob):
    digest, data = blob(1, 2000)
    cache = DiskCachedBlobs(remote, cache_dir, budget_bytes=1000)
    cache.put(digest, data)
    assert cache.get(digest) == data
    assert cached_files(cache_dir) == set()


def test_the_cache_is_taken_up_again_after_a_restart(remote, cache_dir, blob):
    """Its files serve reads again, their order of last read kept (a smaller budget drops the
    oldest read), and a crash's temporary files are removed."""
    old, recent = blob(1, 1000), blob(2, 1000)
    ticks = itertools.count(1_700_000_000)
    first = DiskCachedBlobs(remote, cache_dir, budget_bytes=1 << 20, clock=lambda: next(ticks))
    for digest, data in (recent, old):
        first.put(digest, data)
        first.get(digest)
    first.get(recent[0])
    (cache_dir / f"{old[0]}.0123.part").write_bytes(b"half a file")
    reopened = DiskCachedBlobs(remote, cache_dir, budget_bytes=1000)
    assert cached_files(cache_dir) == {recent[0]}
    assert reopened.get(recent[0]) == recent[1]
    assert remote.gets == 2


def test_delete_removes_the_blob_and_its_copy(remote, cache_dir, blob):
    digest, data = blob(1, 100)
    cache = DiskCachedBlobs(remote, cache_dir, budget_bytes=1 << 20)
    staged = cache.stage(data)
    staged.publish(digest)
    cache.get(digest)
    assert cache.exists(digest)
    assert [entry.digest for entry in cache.listing()] == [digest]
    cache.delete(digest)
    assert cached_files(cache_dir) == set()
    assert not cache.exists(digest)
    with pytest.raises(BlobMissing):
        cache.get(digest)


def test_reads_from_eight_threads_stay_within_the_budget(remote, cache_dir, blob):
    written = dict(blob(seed, 10_000) for seed in range(16))
    cache = DiskCachedBlobs(remote, cache_dir, budget_bytes=50_000)
    for digest, data in written.items():
        cache.put(digest, data)
    reads = [digest for _ in range(4) for digest in written]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(cache.get, reads))
    assert [bytes(data) for data in got] == [written[digest] for digest in reads]
    assert len(cached_files(cache_dir)) <= 5
    assert sum(os.path.getsize(cache_dir / name) for name in cached_files(cache_dir)) <= 50_000
