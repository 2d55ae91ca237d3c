"""Moves a catalog of the single-replica store (SQLite in its data dir, one blob file per adapter
id) into etcd and the blob tier, once, losing nothing.

Each adapter's blob is checked against its sha256 and published under it before its row is
committed, with the id, version and creation time it had; a row already in etcd is left as it is,
so a migration interrupted by a crash is simply run again. Only when every row is in etcd is the
SQLite file renamed ``catalog.sqlite3.migrated`` (kept, for the operator to remove) and the old
blob files removed.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from services.adapter_store.adapter_record import AdapterRecord
from services.adapter_store.blobs.backend import BlobBackend
from services.adapter_store.catalog import Catalog
from services.adapter_store.catalog_keys import record_texts
from services.adapter_store.registrar import sha256_hex

log = logging.getLogger("loramesh.adapter_store")

SQLITE_FILE = "catalog.sqlite3"
LEGACY_BLOB_DIR = "blobs"
LEGACY_BLOB_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class MigrationReport:
    """What one migration moved."""

    adapters: int
    """Rows now in etcd (migrated now or by an earlier, interrupted run)."""
    skipped: tuple[str, ...]
    """``owner/name (why)`` of rows left behind: blob missing or corrupt, name taken in etcd."""


def read_sqlite_catalog(path: Path) -> tuple[list[AdapterRecord], dict[tuple[str, str], int]]:
    """Every row of a SQLite catalog, and each name's last version (names deleted included)."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        columns = {row["name"] for row in db.execute("PRAGMA table_info(adapters)")}
        fields = [f for f in AdapterRecord.__dataclass_fields__ if f in columns]
        records = []
        for row in db.execute("SELECT * FROM adapters ORDER BY seq"):
            values = {f: row[f] for f in fields}
            values["use_rslora"] = bool(values["use_rslora"])
            values["pinned"] = bool(values.get("pinned", False))
            values["target_modules"] = tuple(json.loads(values["target_modules"]))
            records.append(AdapterRecord(**values))
        versions = {
            (row["owner"], row["name"]): row["last_version"]
            for row in db.execute("SELECT owner, name, last_version FROM name_versions")
        }
    finally:
        db.close()
    return records, versions


def migrate_sqlite_catalog(data_dir: Path, catalog: Catalog, blobs: BlobBackend) -> MigrationReport | None:
    """Migrate ``data_dir``'s SQLite catalog if it has one; None when there is nothing to do."""
    path = Path(data_dir) / SQLITE_FILE
    if not path.exists():
        return None
    records, versions = read_sqlite_catalog(path)
    legacy_blobs = Path(data_dir) / LEGACY_BLOB_DIR
    skipped: list[str] = []
    migrated: list[AdapterRecord] = []
    for record in records:
        problem = _publish_blobs(record, legacy_blobs, blobs)
        if problem is None:
            problem = catalog.import_row(record, versions.get((record.owner, record.name), record.version))
        if problem:
            skipped.append(f"{record.owner}/{record.name} ({problem})")
        else:
            migrated.append(record)
    for record in migrated:
        (legacy_blobs / f"{record.id}{LEGACY_BLOB_SUFFIX}").unlink(missing_ok=True)
    report = MigrationReport(len(migrated), tuple(skipped))
    if skipped:
        # The file stays: the next start tries the rows left behind again, and says so again.
        log.error("SQLite catalog %s: %d adapter(s) not migrated: %s", path, len(skipped), "; ".join(skipped))
        return report
    for suffix in ("", "-wal", "-shm"):
        source = path.with_name(path.name + suffix)
        if source.exists():
            source.rename(path.with_name(f"{path.name}.migrated{suffix}"))
    log.warning(
        "migrated the SQLite catalog %s into etcd and %s: %d adapter(s); the file is kept as %s.migrated",
        path, blobs.description, len(migrated), path.name,
    )  # fmt: skip
    return report


def _publish_blobs(record: AdapterRecord, legacy_blobs: Path, blobs: BlobBackend) -> str | None:
    """Put the record's weights (checked) and text parts into the blob tier; why not, or None."""
    if not blobs.exists(record.sha256):
        try:
            weights = (legacy_blobs / f"{record.id}{LEGACY_BLOB_SUFFIX}").read_bytes()
        except FileNotFoundError:
            return "weights blob missing"
        if sha256_hex(weights) != record.sha256:
            return "weights blob fails its sha256 check"
        blobs.put(record.sha256, weights)
    for digest, data in record_texts(record).items():
        if not blobs.exists(digest):
            blobs.put(digest, data)
    blobs.flush()
    return None
