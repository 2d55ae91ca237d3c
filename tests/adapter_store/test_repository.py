"""The repository alone (no gRPC): durability on reopen, orphan and corrupt blob handling,
the RAM tier's byte budget."""

from __future__ import annotations

import hashlib

import pytest

from services.adapter_store.catalog import PRIVATE
from services.adapter_store.ram_tier import RamTier
from services.adapter_store.registrar import AdapterUpload
from services.adapter_store.repository import AdapterKey, AdapterRepository
from services.adapter_store.validation import ValidationLimits
from services.runtime.errors import AlreadyExists, DataLoss, InvalidArgument, NotFound

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@pytest.fixture
def open_repo(tmp_path, base_spec):
    opened = []

    def open_repo(ram_budget_bytes: int = 64 << 20, verify: str = "sha256") -> AdapterRepository:
        repo = AdapterRepository(tmp_path / "store", base_spec, ValidationLimits(), ram_budget_bytes, verify)
        repo.open_report = repo.open()
        opened.append(repo)
        return repo

    yield open_repo
    for repo in opened:
        repo.close()


def add(repo, files, name):
    return repo.registrar.register(AdapterUpload(name, "alice", PRIVATE, files[CONFIG], files[WEIGHTS]))


def test_reopen_restores_every_adapter_byte_identical(open_repo, sample_files):
    repo = open_repo()
    records = [add(repo, sample_files, f"a{i}") for i in range(3)]
    repo.delete(AdapterKey(id=records[1].id))
    repo.close()
    again = open_repo()
    assert [r.name for r in again.catalog.all()] == ["a0", "a2"]
    for record in (records[0], records[2]):
        data = again.read_weights(again.resolve(AdapterKey(owner="alice", name=record.name)))
        assert hashlib.sha256(data).hexdigest() == record.sha256
    with pytest.raises(NotFound):
        again.resolve(AdapterKey(id=records[1].id))


def test_orphan_blob_and_temp_files_from_a_crash_are_removed(open_repo, sample_files):
    repo = open_repo()
    add(repo, sample_files, "kept")
    # A crash after the blob was renamed but before the catalog commit leaves an orphan blob;
    # one during the write leaves a temp file.
    repo.blobs.write("f" * 32, b"orphan bytes")
    (repo.blobs.tmp_dir / "x.part").write_bytes(b"half")
    repo.close()
    again = open_repo()
    report = again.open_report
    assert (report.adapters, report.orphan_blobs_removed, report.temp_files_removed) == (1, 1, 1)
    assert again.blobs.ids() == {again.catalog.all()[0].id}
    assert list(again.blobs.tmp_dir.iterdir()) == []


def test_corrupt_blob_is_quarantined_not_served(open_repo, sample_files):
    repo = open_repo()
    good, bad = add(repo, sample_files, "good"), add(repo, sample_files, "bad")
    repo.close()
    path = repo.blobs.path(bad.id)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    again = open_repo()
    assert [r.name for r in again.catalog.all()] == ["good"]
    assert (again.data_dir / "quarantine" / path.name).exists()
    assert again.read_weights(again.resolve(AdapterKey(id=good.id))) == sample_files[WEIGHTS]


def test_blob_corrupted_while_running_is_data_loss(open_repo, sample_files):
    repo = open_repo(ram_budget_bytes=0)
    record = add(repo, sample_files, "a")
    repo.blobs.path(record.id).write_bytes(b"x" * record.size_bytes)
    with pytest.raises(DataLoss):
        repo.read_weights(record)


def test_ram_tier_stays_within_budget_and_disk_serves_the_rest(open_repo, sample_files):
    size = len(sample_files[WEIGHTS])
    repo = open_repo(ram_budget_bytes=int(size * 2.5))
    records = [add(repo, sample_files, f"a{i}") for i in range(6)]
    assert len(repo.ram) == 0  # registering is not using: the hot set is left as it was
    for record in records:
        assert repo.read_weights(record) == sample_files[WEIGHTS]
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


def test_names_and_duplicates(open_repo, sample_files):
    repo = open_repo()
    add(repo, sample_files, "a")
    with pytest.raises(AlreadyExists):
        add(repo, sample_files, "a")
    for bad in ["", "has space", "-leading", "x" * 129, "../etc"]:
        with pytest.raises(InvalidArgument, match="name"):
            add(repo, sample_files, bad)
    assert repo.catalog.count() == 1 and len(repo.blobs.ids()) == 1
