"""The single-replica store's SQLite catalog as the store wrote it before the catalog moved to
etcd (issue 48), kept so tests can build one and watch a store migrate it."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

from services.adapter_store.adapter_record import AdapterRecord, DuplicateName
from services.runtime.security.private_files import private_dir

_SCHEMA = """
CREATE TABLE IF NOT EXISTS adapters (
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,
    id             TEXT NOT NULL UNIQUE,
    name           TEXT NOT NULL,
    owner          TEXT NOT NULL,
    visibility     INTEGER NOT NULL,
    base_model     TEXT NOT NULL,
    pet_type       TEXT NOT NULL,
    rank           INTEGER NOT NULL,
    max_rank       INTEGER NOT NULL,
    lora_alpha     REAL NOT NULL,
    use_rslora     INTEGER NOT NULL,
    target_modules TEXT NOT NULL,
    dtype          TEXT NOT NULL,
    size_bytes     INTEGER NOT NULL,
    sha256         TEXT NOT NULL,
    version        INTEGER NOT NULL,
    created_ms     INTEGER NOT NULL,
    config_json    TEXT NOT NULL,
    UNIQUE (owner, name)
);
CREATE INDEX IF NOT EXISTS adapters_by_owner ON adapters (owner, seq);
CREATE TABLE IF NOT EXISTS name_versions (
    owner        TEXT NOT NULL,
    name         TEXT NOT NULL,
    last_version INTEGER NOT NULL,
    PRIMARY KEY (owner, name)
);
"""

#: Columns added since the first schema, with their definitions, added to any catalog that
#: lacks them when it is opened (a catalog's adapters from before have no template of their own).
_ADDED_COLUMNS = {
    "chat_template": "TEXT NOT NULL DEFAULT ''",
    "tool_use_chat_template": "TEXT NOT NULL DEFAULT ''",
    "pinned": "INTEGER NOT NULL DEFAULT 0",
}

_COLUMNS = [f for f in AdapterRecord.__dataclass_fields__]


class LegacySqliteCatalog:
    """Thread-safe access to the SQLite catalog: one connection writes, another reads, each
    behind its own lock. In WAL mode a read never waits for a write's commit to reach the disk,
    so looking an adapter up (every registration does, every fetch does) is not held up by the
    flush of another registration's commit."""

    def __init__(self, path: Path):
        private_dir(path.parent)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            present = {row["name"] for row in self._db.execute("PRAGMA table_info(adapters)")}
            for column, definition in _ADDED_COLUMNS.items():
                if column not in present:
                    self._db.execute(f"ALTER TABLE adapters ADD COLUMN {column} {definition}")
        self._reader = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._reader.row_factory = sqlite3.Row
        self._reader.execute("PRAGMA query_only=1")
        self._read_lock = threading.Lock()

    def close(self) -> None:
        with self._read_lock:
            self._reader.close()
        with self._lock:
            self._db.close()

    def next_version(self, owner: str, name: str) -> int:
        with self._read_lock:
            row = self._reader.execute(
                "SELECT last_version FROM name_versions WHERE owner=? AND name=?", (owner, name)
            ).fetchone()
        return (row[0] if row else 0) + 1

    def insert_many(self, entries: Sequence[tuple[AdapterRecord, str]]) -> list[DuplicateName | None]:
        """Commit ``(record, replacing)`` pairs in one transaction (one flush of the WAL); for
        each, :class:`DuplicateName` if its ``(owner, name)`` is taken (that row alone is left
        out), else None.

        ``replacing``: the id of the row ``record`` takes the place of ("" for none), removed in
        the same transaction, so readers see the old version or the new one, never neither."""
        results: list[DuplicateName | None] = []
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                for record, replacing in entries:
                    results.append(self._insert_one(record, replacing))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return results

    def _insert_one(self, record: AdapterRecord, replacing: str) -> DuplicateName | None:
        values = {column: getattr(record, column) for column in _COLUMNS}  # asdict deep-copies
        values["use_rslora"] = int(record.use_rslora)
        values["pinned"] = int(record.pinned)
        values["target_modules"] = json.dumps(list(record.target_modules))
        placeholders = ", ".join(f":{c}" for c in _COLUMNS)
        self._db.execute("SAVEPOINT one")
        try:
            if replacing:
                self._db.execute("DELETE FROM adapters WHERE id=?", (replacing,))
            self._db.execute(f"INSERT INTO adapters ({', '.join(_COLUMNS)}) VALUES ({placeholders})", values)
            self._db.execute(
                "INSERT INTO name_versions (owner, name, last_version) VALUES (?, ?, ?) "
                "ON CONFLICT (owner, name) DO UPDATE SET last_version = excluded.last_version",
                (record.owner, record.name, record.version),
            )
        except sqlite3.IntegrityError as error:
            self._db.execute("ROLLBACK TO one")
            self._db.execute("RELEASE one")
            duplicate = DuplicateName(f"{record.owner}/{record.name}")
            duplicate.__cause__ = error
            return duplicate
        self._db.execute("RELEASE one")
        return None

    def delete(self, adapter_id: str) -> bool:
        with self._lock:
            cursor = self._db.execute("DELETE FROM adapters WHERE id=?", (adapter_id,))
        return cursor.rowcount > 0
