"""The repository alone (no gRPC), on a real etcd: durability on reopen, orphan and corrupt blob
handling, the RAM tier's byte budget."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from services.adapter_store.adapter_record import PRIVATE
from services.adapter_store.ram_tier import RamTier
from services.adapter_store.registrar import AdapterUpload
from services.adapter_store.repository import AdapterKey
from services.runtime.errors import AlreadyExists, DataLoss, InvalidArgument, NotFound

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
HOUR = 3600.0


def add(repo, files, name):
    return repo.registrar.register(AdapterUpload(name, "alice", PRIVATE, files[CONFIG], files[WEIGHTS]))


def test_reopen_restores_every_adapter_byte_identical(open_repository, seeded_files):
    repo = open_repository()
    records = [add(repo, seeded_files(i), f"a{i}") for i in range(3)]
    repo.delete(AdapterKey(id=records[1].id))
    repo.close()
    again = open_repository()
    assert [r.name for r in again.catalog.all()] == ["a0", "a2"]
    for record in (records[0], records[2]):
        data = again.read_weights(again.resolve(AdapterKey(owner="alice", name=record.name)))
        assert hashlib.sha256(data).hexdigest() == record.sha256
    with pytest.raises(NotFound):
        again.resolve(AdapterKey(id=records[1].id))


def test_orphan_blobs_and_staged_files_from_a_crash_are_removed_once_old(open_repository, sample_files):
    """A crash after a blob was published but before its row committed leaves an orphan blob;
    one during the write leaves a staged file. Both go once older than the grace period (a
    replica sharing the directory may be writing them right now)."""
    now = [time.time()]
    repo = open_repository(clock=lambda: now[0])
    kept = add(repo, sample_files, "kept")
    repo.blobs.put("f" * 64, b"orphan bytes")
    (repo.blobs.staging_dir / "x.part").write_bytes(b"half")
    repo.close()
    young = open_repository(clock=lambda: now[0])
    assert (young.open_report.orphan_blobs_removed, young.open_report.temp_files_removed) == (0, 0)
    young.close()
    now[0] += 2 * HOUR
    old = open_repository(clock=lambda: now[0])
    report = old.open_report
    assert (report.adapters, report.orphan_blobs_removed, report.temp_files_removed) == (1, 1, 1)
    assert {entry.digest for entry in old.blobs.listing()} == {
        kept.sha256,
        hashlib.sha256(sample_files[CONFIG]).hexdigest(),
    }
    assert list(old.blobs.staging_dir.iterdir()) == []


def test_a_deleted_adapters_blobs_are_collected_but_shared_ones_stay(open_repository, seeded_files):
    now = [time.time()]
    repo = open_repository(clock=lambda: now[0])
    gone, twin, other = (
        add(repo, seeded_files(0), "gone"),
        add(repo, seeded_files(0), "twin"),
        add(repo, seeded_files(1), "other"),
    )
    repo.delete(AdapterKey(id=gone.id))
    repo.delete(AdapterKey(id=other.id))
    now[0] += 2 * HOUR
    assert repo.collector.collect() == 1  # other's weights; its config is the same bytes as the twin's
    assert repo.blobs.exists(twin.sha256) and not repo.blobs.exists(other.sha256)
    assert repo.read_weights(twin) == seeded_files(0)[WEIGHTS]


def test_corrupt_blob_is_quarantined_not_served(open_repository, seeded_files):
    repo = open_repository(verify_on_open="sha256")
    good, bad = add(repo, seeded_files(0), "good"), add(repo, seeded_files(1), "bad")
    repo.close()
    path = repo.blobs.path(bad.sha256)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    again = open_repository(verify_on_open="sha256")
    assert again.open_report.corrupt_quarantined == 1
    assert [r.name for r in again.catalog.all()] == ["good"]
    assert not path.exists()  # a registration of the same weights writes them afresh
    assert again.read_weights(again.resolve(AdapterKey(id=good.id))) == seeded_files(0)[WEIGHTS]


def test_blob_corrupted_while_running_is_data_loss(open_repository, sample_files):
    repo = open_repository(ram_budget_bytes=0)
    record = add(repo, sample_files, "a")
    path = repo.blobs.path(record.sha256)
    os.chmod(path, 0o600)
    path.write_bytes(b"x" * record.size_bytes)
    with pytest.raises(DataLoss):
        repo.read_weights(record)


def test_ram_tier_stays_within_budget_and_the_blob_tier_serves_the_rest(open_repository, seeded_files):
    size = len(seeded_files(0)[WEIGHTS])
    repo = open_repository(ram_budget_bytes=int(size * 2.5))
    records = [add(repo, seeded_files(i), f"a{i}") for i in range(6)]
    assert len(repo.ram) == 0  # registering is not using: the hot set is left as it was
    for i, record in enumerate(records):
        assert repo.read_weights(record) == seeded_files(i)[WEIGHTS]
        assert repo.ram.bytes_used <= repo.ram.budget_bytes
    assert len(repo.ram) == 2
    stats = repo.stats()
    assert stats.adapters == 6 and stats.disk_bytes == 6 * size and stats.ram_misses == 6


def test_lru_keeps_the_recently_used():
    tier = RamTier(budget_bytes=30)
    for key in "abc":
        tier.put(key, b"x" * 10)
    assert tier.get("a") is not None  # a is now the most recent
    tier.put("d", b"y" * 10)
    assert tier.get("b") is None and tier.get("a") is not None and tier.get("d") is not None
    assert not tier.put("huge", b"z" * 31) and tier.bytes_used == 30


def test_names_and_duplicates(open_repository, sample_files):
    repo = open_repository()
    add(repo, sample_files, "a")
    with pytest.raises(AlreadyExists):
        add(repo, sample_files, "a")
    for bad in ["", "has space", "-leading", "x" * 129, "../etc"]:
        with pytest.raises(InvalidArgument, match="name"):
            add(repo, sample_files, bad)
    assert repo.catalog.count() == 1 and len(list(repo.blobs.listing())) == 2  # weights and config
