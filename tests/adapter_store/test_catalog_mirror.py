"""Each replica's copy of the catalog, alone (no etcd): registration order, paging, names."""

from __future__ import annotations

from dataclasses import replace

from services.adapter_store.adapter_record import PRIVATE, PUBLIC, AdapterRecord
from services.adapter_store.catalog_changes import CatalogChange, CatalogChanges
from services.adapter_store.catalog_mirror import CatalogMirror

BASE = AdapterRecord(
    id="", name="", owner="alice", visibility=PRIVATE, base_model="m", pet_type="lora", rank=1, max_rank=1,
    lora_alpha=1.0, use_rslora=False, target_modules=("q_proj",), dtype="float16", size_bytes=1,
    sha256="0" * 64, version=1, created_ms=0, config_json="{}",
)  # fmt: skip


def record(name: str, **fields) -> AdapterRecord:
    return replace(BASE, id=f"id-{name}", name=name, **fields)


def pages(mirror: CatalogMirror, owner=None, include_public=False, size=2) -> list[str]:
    names, after = [], (0, "")
    while True:
        page, _ = mirror.page(owner, include_public, after, size)
        if not page:
            return names
        names += [r.name for _, r in page]
        after = page[-1][0]


def test_rows_committed_in_one_transaction_are_each_listed_once():
    """Rows a group commit wrote share one create revision: each still has its own place."""
    mirror = CatalogMirror()
    mirror.upsert(5, record("a"), 5)
    for name in ("d", "b", "c"):
        mirror.upsert(7, record(name), 7)
    mirror.upsert(9, record("e"), 9)
    assert pages(mirror) == ["a", "b", "c", "d", "e"]
    assert mirror.remove("id-c", 10) == CatalogChange(deleted_id="id-c")
    assert pages(mirror) == ["a", "b", "d", "e"] and mirror.count() == 4


def test_a_listing_replaces_the_copy_and_says_what_changed():
    mirror = CatalogMirror()
    mirror.upsert(1, record("a"), 1)
    mirror.upsert(2, record("b"), 2)
    b_public = record("b", visibility=PUBLIC)
    changes = mirror.replace([(2, b_public), (3, record("c", owner="bob"))], revision=3)
    assert sorted(changes, key=repr) == sorted(
        [
            CatalogChange(deleted_id="id-a"),
            CatalogChange(upserted=b_public),
            CatalogChange(upserted=record("c", owner="bob")),
        ],
        key=repr,
    )
    assert mirror.get_by_name("alice", "a") is None and mirror.get_by_name("bob", "c").id == "id-c"
    assert pages(mirror, owner="bob") == ["c"]
    assert pages(mirror, owner="bob", include_public=True) == ["b", "c"]
    assert mirror.revision == 3


def test_a_new_version_takes_the_name_and_the_old_row_leaves_it():
    mirror = CatalogMirror()
    old, new = record("a"), replace(record("a"), id="id-a2", version=2)
    mirror.upsert(1, old, 1)
    mirror.remove(old.id, 2)
    mirror.upsert(2, new, 2)
    assert mirror.get_by_name("alice", "a") == new and mirror.all() == [new]
    assert mirror.referenced_digests() == {
        "0" * 64,
        "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",
    }


def test_a_replicas_own_registration_is_shown_at_once_and_published_once():
    changes = CatalogChanges()
    published: list[CatalogChange] = []
    changes.subscribe(published.append)
    mirror = CatalogMirror(changes)
    old, new = record("a"), replace(record("a"), id="id-a2", version=2)
    mirror.upsert(3, old, 3)
    assert mirror.apply_own(8, new, replaced=old.id) == [
        CatalogChange(deleted_id=old.id),
        CatalogChange(upserted=new),
    ]
    assert mirror.get_by_name("alice", "a") == new and mirror.revision == 3
    # The watch then delivers the same transaction: nothing changes, nothing is published again.
    assert mirror.remove(old.id, 8) is None and mirror.upsert(8, new, 8) is None
    assert published == [
        CatalogChange(upserted=old),
        CatalogChange(deleted_id=old.id),
        CatalogChange(upserted=new),
    ]
    # A write the watch has already gone past (and perhaps a later delete with it) is left alone.
    mirror.remove(new.id, 9)
    assert mirror.apply_own(8, new) == [] and mirror.get(new.id) is None


def test_an_own_registration_is_shown_when_the_watch_stopped_inside_its_transaction():
    """The watch applies a transaction's events one at a time: after the replaced row's delete
    the mirror is at the transaction's revision without the new row. The writer must still read
    its row back at once."""
    mirror = CatalogMirror()
    old, new = record("a"), replace(record("a"), id="id-a2", version=2)
    mirror.upsert(3, old, 3)
    mirror.remove(old.id, 8)
    assert mirror.apply_own(8, new, replaced=old.id) == [CatalogChange(upserted=new)]
    assert mirror.versions("alice", "a") == [new] and mirror.get_by_name("alice", "a") == new
    assert mirror.upsert(8, new, 8) is None
