"""The last versions of a name, kept after newer ones (services/adapter_store/version_retention.py),
on a real etcd: what is kept and pruned (rows and blobs), rollbacks, deletion, and what another
replica's catalog shows."""

from __future__ import annotations

import hashlib
import time

import pytest

from services.adapter_store import registrar as registrar_module
from services.adapter_store.adapter_record import PRIVATE
from services.adapter_store.registrar import AdapterUpload
from services.adapter_store.repository import AdapterKey
from services.adapter_store.storage_usage import stored_bytes
from services.runtime.errors import NotFound

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def publish(repo, files, name="a"):
    upload = AdapterUpload(name, "alice", PRIVATE, files[CONFIG], files[WEIGHTS])
    return repo.registrar.register_version(upload)


def weights_digest(repo, adapter_id: str) -> str:
    return hashlib.sha256(repo.read_weights(repo.resolve(AdapterKey(id=adapter_id)))).hexdigest()


def test_a_name_keeps_its_last_versions_and_older_ones_go_with_their_blobs(
    tmp_path, open_repository, seeded_files
):
    repo = open_repository(blob_dir=tmp_path / "blobs", keep_versions=3, collect_grace_s=0)
    records = [publish(repo, seeded_files(seed)).record for seed in range(5)]
    assert [r.version for r in records] == [1, 2, 3, 4, 5]

    assert [r.version for r in repo.retention.versions("alice", "a")] == [3, 4, 5]
    assert [r.id for r in repo.catalog.all()] == [records[4].id]  # listings: the serving one
    assert [r.id for r in repo.list("alice")[0]] == [records[4].id]
    # What a store's WatchAdapters lists: every version a watch of the rows in etcd sees.
    assert [r.version for r in repo.list(kept=True)[0]] == [3, 4, 5]
    assert repo.resolve(AdapterKey(owner="alice", name="a")).id == records[4].id
    for kept in records[2:]:  # a worker still fetches a kept version by id
        assert weights_digest(repo, kept.id) == kept.sha256
    for pruned in records[:2]:
        with pytest.raises(NotFound):
            repo.resolve(AdapterKey(id=pruned.id))
    usage = repo.catalog.usage("alice")  # quotas count the serving version
    assert (usage.adapters, usage.bytes) == (1, stored_bytes(records[4]))

    repo.collector.collect()
    held = {entry.digest for entry in repo.blobs.listing()}
    assert {r.sha256 for r in records[2:]} <= held
    assert not {r.sha256 for r in records[:2]} & held

    other = open_repository(blob_dir=tmp_path / "blobs", keep_versions=3)  # another replica lists
    assert [r.version for r in other.retention.versions("alice", "a")] == [3, 4, 5]
    assert [r.id for r in other.catalog.all()] == [records[4].id]
    assert other.resolve(AdapterKey(owner="alice", name="a")).id == records[4].id


def test_publishing_a_kept_versions_content_again_is_a_rollback_without_validation(
    open_repository, seeded_files, monkeypatch
):
    repo = open_repository(keep_versions=4)
    first = publish(repo, seeded_files(10)).record
    publish(repo, seeded_files(11))
    writes = []
    monkeypatch.setattr(registrar_module, "validate_adapter", lambda *a: pytest.fail("validated again"))
    monkeypatch.setattr(repo.blobs, "put", lambda digest, data: writes.append(digest))
    monkeypatch.setattr(repo.blobs, "stage", lambda data: pytest.fail("weights staged again"))

    rolled_back = publish(repo, seeded_files(10))

    assert rolled_back.changed
    record = rolled_back.record
    assert (record.version, record.sha256, record.rank) == (3, first.sha256, first.rank)
    assert record.id != first.id  # a version of its own: nothing keyed by id mixes them
    assert writes == []
    assert repo.resolve(AdapterKey(owner="alice", name="a")).id == record.id
    assert weights_digest(repo, record.id) == first.sha256
    assert [r.version for r in repo.retention.versions("alice", "a")] == [1, 2, 3]


def test_deleting_a_name_deletes_its_kept_versions(open_repository, seeded_files):
    repo = open_repository(keep_versions=4, collect_grace_s=0)
    records = [publish(repo, seeded_files(seed)).record for seed in (20, 21, 22)]
    repo.delete(AdapterKey(owner="alice", name="a"))
    assert repo.retention.versions("alice", "a") == []
    for record in records:
        with pytest.raises(NotFound):
            repo.resolve(AdapterKey(id=record.id))
    repo.collector.collect()
    assert not {r.sha256 for r in records} & {entry.digest for entry in repo.blobs.listing()}
    assert publish(repo, seeded_files(20)).record.version == 4  # numbers are never reused


def test_keeping_one_version_removes_the_one_replaced(open_repository, seeded_files):
    repo = open_repository(keep_versions=1)
    first = publish(repo, seeded_files(30)).record
    second = publish(repo, seeded_files(31)).record
    assert [r.id for r in repo.retention.versions("alice", "a")] == [second.id]
    with pytest.raises(NotFound):
        repo.resolve(AdapterKey(id=first.id))


def test_a_version_replaced_less_than_keep_versions_s_ago_is_kept_past_the_count(
    open_repository, seeded_files
):
    """At a training loop's pace the count alone keeps a version a fraction of a second, less
    than a request admitted on it may take to reach its worker, which fetches it by id then."""
    now = [time.time()]
    repo = open_repository(keep_versions=2, keep_versions_s=60, clock=lambda: now[0])
    records = [publish(repo, seeded_files(seed)).record for seed in (40, 41, 42, 43)]
    assert [r.version for r in repo.retention.versions("alice", "a")] == [1, 2, 3, 4]
    assert weights_digest(repo, records[0].id) == records[0].sha256

    now[0] += 61  # every one replaced over a minute ago: the count decides
    publish(repo, seeded_files(44))
    assert [r.version for r in repo.retention.versions("alice", "a")] == [4, 5]


def test_a_new_version_is_served_from_ram_without_reading_its_blob_back(
    open_repository, seeded_files, monkeypatch
):
    """Every worker serving a name pulls its new version at once: the replica that took the
    publish serves it from its RAM tier, not by reading the blob back and hashing it again.
    A new name waits for its first fetch (registering thousands evicts nothing)."""
    repo = open_repository()
    first = publish(repo, seeded_files(50)).record
    assert repo.ram.get(first.sha256) is None
    second = publish(repo, seeded_files(51)).record
    monkeypatch.setattr(repo.blobs, "get", lambda digest: pytest.fail("read back from the blob tier"))
    assert bytes(repo.read_weights(second)) == seeded_files(51)[WEIGHTS]
    assert weights_digest(repo, second.id) == second.sha256
