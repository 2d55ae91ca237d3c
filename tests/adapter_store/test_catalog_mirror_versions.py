"""A replica's copy of the catalog with several versions of a name (the serving one and kept
ones, services/adapter_store/version_retention.py), alone (no etcd): what lookups by name,
listings, counts and pins see, in whatever order the rows arrive."""

from __future__ import annotations

from dataclasses import replace

from services.adapter_store.adapter_record import PRIVATE, AdapterRecord
from services.adapter_store.catalog_mirror import CatalogMirror

BASE = AdapterRecord(
    id="", name="policy", owner="alice", visibility=PRIVATE, base_model="m", pet_type="lora", rank=1,
    max_rank=1, lora_alpha=1.0, use_rslora=False, target_modules=("q_proj",), dtype="float16",
    size_bytes=1, sha256="0" * 64, version=1, created_ms=0, config_json="{}",
)  # fmt: skip


def version(number: int, **fields) -> AdapterRecord:
    return replace(BASE, id=f"v{number}", version=number, **fields)


def test_a_listing_in_any_order_serves_the_highest_version_and_lists_only_it():
    mirror = CatalogMirror()
    rows = [(3, version(3, pinned=True)), (1, version(1, pinned=True)), (2, version(2))]
    mirror.replace(rows, 3)  # etcd lists rows by key (their ids), not by version
    assert mirror.get_by_name("alice", "policy").id == "v3"
    assert [r.id for r in mirror.all()] == ["v3"]
    assert mirror.count() == 1
    assert [r.id for _, r in mirror.page("alice", False, (0, ""), 10)[0]] == ["v3"]
    assert mirror.page(None, False, (0, ""), 10)[1] == 1
    assert mirror.page(None, False, (0, ""), 10, kept=True)[1] == 3
    assert mirror.pinned_sizes() == {"v3": 1}  # a kept version's old pin is not the name's
    assert [r.id for r in mirror.versions("alice", "policy")] == ["v1", "v2", "v3"]
    assert mirror.get("v1") == version(1, pinned=True)  # fetched by id while kept
    assert "0" * 64 in mirror.referenced_digests()  # the collector leaves kept blobs


def test_a_new_version_serves_at_once_and_pruning_kept_ones_leaves_it():
    mirror = CatalogMirror()
    mirror.upsert(1, version(1), 1)
    mirror.apply_own(2, version(2))  # a publish that keeps version 1
    assert mirror.get_by_name("alice", "policy").id == "v2"
    mirror.remove("v1", 3)  # pruned
    assert mirror.get_by_name("alice", "policy").id == "v2"
    assert [r.id for r in mirror.versions("alice", "policy")] == ["v2"]


def test_deleting_the_serving_version_never_brings_back_a_kept_one():
    mirror = CatalogMirror()
    mirror.replace([(1, version(1)), (2, version(2))], 2)
    mirror.remove("v2", 3)  # the name's delete removes the serving row first
    assert mirror.get_by_name("alice", "policy") is None and mirror.all() == []
    mirror.remove("v1", 3)
    assert mirror.versions("alice", "policy") == []
