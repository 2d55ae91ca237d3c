"""A store started on the single-replica store's data directory (a SQLite catalog, one blob file
per adapter id) moves it into etcd and the blob tier once, losing nothing, and says so."""

from __future__ import annotations

import hashlib
import logging
import sqlite3
import time
import uuid
from pathlib import Path

import grpc
import pytest
from support.legacy_sqlite_catalog import LegacySqliteCatalog

from mesh_api.adapter_transfer import ref_by_id, ref_by_name
from mesh_api.v1 import adapter_store_pb2 as pb
from services.adapter_store.adapter_record import PRIVATE, PUBLIC, AdapterRecord
from services.adapter_store.sqlite_migration import migrate_sqlite_catalog

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def legacy_record(files, name, version=1, **fields) -> AdapterRecord:
    weights = files[WEIGHTS]
    return AdapterRecord(
        id=uuid.uuid4().hex, name=name, owner="alice", visibility=fields.pop("visibility", PRIVATE),
        base_model="SmolLM2-135M-Instruct", pet_type="lora", rank=8, max_rank=8, lora_alpha=16.0,
        use_rslora=False, target_modules=("k_proj", "o_proj", "q_proj", "v_proj"), dtype="float16",
        size_bytes=len(weights), sha256=hashlib.sha256(weights).hexdigest(), version=version,
        created_ms=int(time.time() * 1000), config_json=files[CONFIG].decode(), **fields,
    )  # fmt: skip


def write_legacy_store(
    data_dir: Path, entries: list[tuple[AdapterRecord, bytes]], last_versions=None
) -> None:
    """What last round's store left in its data directory."""
    catalog = LegacySqliteCatalog(data_dir / "catalog.sqlite3")
    (data_dir / "blobs").mkdir(parents=True, exist_ok=True)
    for record, weights in entries:
        (data_dir / "blobs" / f"{record.id}.safetensors").write_bytes(weights)
    assert catalog.insert_many([(record, "") for record, _ in entries]) == [None] * len(entries)
    catalog.close()
    if last_versions:
        db = sqlite3.connect(data_dir / "catalog.sqlite3")
        db.executemany(
            "UPDATE name_versions SET last_version=? WHERE name=?", [(v, n) for n, v in last_versions.items()]
        )
        db.commit()
        db.close()


@pytest.fixture
def legacy_store(tmp_path, seeded_files):
    """The store's data dir as last round left it: three adapters, one pinned, one public with
    its own chat template, one whose name had two versions before."""
    entries = [
        (legacy_record(seeded_files(0), "plain"), seeded_files(0)[WEIGHTS]),
        (legacy_record(seeded_files(1), "templated", visibility=PUBLIC, chat_template=TEMPLATE), seeded_files(1)[WEIGHTS]),
        (legacy_record(seeded_files(2), "pinned", version=3, pinned=True), seeded_files(2)[WEIGHTS]),
    ]  # fmt: skip
    write_legacy_store(tmp_path / "store", entries, last_versions={"pinned": 3})
    return entries


def test_a_store_started_on_a_sqlite_catalog_serves_every_adapter_it_held(
    legacy_store, store_server, store_stub, tmp_path
):
    data_dir = tmp_path / "store"
    for record, weights in legacy_store:
        info = store_stub.GetAdapter(pb.GetAdapterRequest(ref=ref_by_id(record.id)))
        assert (info.name, info.version, info.pinned, info.chat_template) == (
            record.name, record.version, record.pinned, record.chat_template,
        )  # fmt: skip
        messages = list(
            store_stub.FetchAdapter(pb.FetchAdapterRequest(ref=ref_by_name("alice", record.name)))
        )
        assert b"".join(m.chunk for m in messages[1:]) == weights
    assert store_stub.ListPinnedAdapters(pb.ListPinnedAdaptersRequest()).adapter_ids == [
        legacy_store[2][0].id
    ]
    assert (data_dir / "catalog.sqlite3.migrated").exists() and not (data_dir / "catalog.sqlite3").exists()
    assert list((data_dir / "blobs").iterdir()) == []  # moved into the content-addressed tier
    with pytest.raises(grpc.RpcError) as err:
        store_stub.GetAdapter(pb.GetAdapterRequest(ref=ref_by_name("alice", "missing")))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_migration_is_run_again_after_a_crash_and_keeps_the_versions(
    open_repository, tmp_path, seeded_files, caplog
):
    data_dir = tmp_path / "legacy"
    record = legacy_record(seeded_files(0), "a", version=2)
    write_legacy_store(data_dir, [(record, seeded_files(0)[WEIGHTS])], last_versions={"a": 5})
    repository = open_repository()
    # A crash after the row reached etcd, before the file was renamed: the next start migrates again.
    first = migrate_sqlite_catalog(data_dir, repository.catalog, repository.blobs)
    (data_dir / "catalog.sqlite3.migrated").rename(data_dir / "catalog.sqlite3")
    with caplog.at_level(logging.WARNING, "loramesh.adapter_store"):
        again = migrate_sqlite_catalog(data_dir, repository.catalog, repository.blobs)
    assert first.adapters == again.adapters == 1 and again.skipped == ()
    assert "migrated the SQLite catalog" in caplog.text
    assert repository.catalog.get(record.id) == record
    assert repository.catalog.prepare("alice", "a", set()).last_version == 5  # the next is 6
    assert migrate_sqlite_catalog(data_dir, repository.catalog, repository.blobs) is None


def test_a_row_whose_blob_is_corrupt_is_left_behind_and_the_file_kept(
    open_repository, tmp_path, seeded_files
):
    data_dir = tmp_path / "legacy"
    good, bad = legacy_record(seeded_files(0), "good"), legacy_record(seeded_files(1), "bad")
    write_legacy_store(data_dir, [(good, seeded_files(0)[WEIGHTS]), (bad, b"not the weights")])
    repository = open_repository()
    report = migrate_sqlite_catalog(data_dir, repository.catalog, repository.blobs)
    assert report.adapters == 1 and report.skipped == ("alice/bad (weights blob fails its sha256 check)",)
    assert (data_dir / "catalog.sqlite3").exists()  # tried again, and reported again, next start
    assert (data_dir / "blobs" / f"{bad.id}.safetensors").exists()
    assert repository.catalog.get(good.id) == good and repository.catalog.get(bad.id) is None
