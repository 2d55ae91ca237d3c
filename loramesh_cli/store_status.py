"""``loramesh status``'s adapter store table: every store replica registered in etcd, with its
catalog's state and adapter count from its load report (``catalog``: "ok" or the problem it
has with etcd; ``adapters``), and the blob tier the replicas share (``blob_store``: the
backend's description, a directory or ``s3://bucket/prefix``)."""

from __future__ import annotations

from loramesh_cli.table import render_table

STORE_SERVICE = "adapter_store"
STORE_KEYS = frozenset({"catalog", "blob_store"})
"""Load report keys this table shows, left out of the status table's LOAD column (``adapters``
stays there too: it is short)."""
HEADERS = ["STORE", "ADDRESS", "HEALTH", "CATALOG", "ADAPTERS"]


def shared_tier(blob_store: str) -> str:
    """The blob tier a replica names, without its own disk cache in front of a bucket
    (``s3://b/p (disk cache /data/blob_cache)``: services/adapter_store/blobs/disk_cache.py)."""
    return blob_store.split(" (disk cache ", 1)[0]


def store_table(rows: list[dict]) -> str | None:
    """The table of the adapter_store rows of ``loramesh status``, headed by the blob tier they
    share (None when no store is registered). Replicas that name different blob tiers do not
    serve each other's adapters: each replica's is listed then, under a warning."""
    stores = [r for r in rows if r["service"] == STORE_SERVICE]
    if not stores:
        return None
    blob_stores = {shared_tier(r["load"]["blob_store"]) for r in stores if r["load"].get("blob_store")}
    table = render_table(
        HEADERS,
        [
            [
                r["instance"],
                r["address"],
                r["health"],
                r["load"].get("catalog", "-"),
                r["load"].get("adapters", "-"),
            ]
            for r in stores
        ],
    )
    replicas = f"{len(stores)} replica" + ("s" if len(stores) > 1 else "")
    if len(blob_stores) <= 1:
        blob = next(iter(blob_stores), "not reported yet")
        return f"Adapter stores ({replicas}; blob store {blob})\n{table}"
    listed = "; ".join(
        f"{r['instance']}: {r['load']['blob_store']}" for r in stores if r["load"].get("blob_store")
    )
    return (
        f"Adapter stores ({replicas}); WARNING: the replicas use different blob stores, so an "
        f"adapter one wrote may be missing from another: {listed}\n{table}"
    )
