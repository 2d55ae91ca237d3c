"""The adapter catalog: one SQLite database in WAL mode, the single source of truth.

A row exists only for an adapter whose blob was durably written first, so a crash between the
two leaves at worst an orphan blob, which start-up removes. ``(owner, name)`` is unique.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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

PRIVATE = 1
PUBLIC = 2


@dataclass(frozen=True)
class AdapterRecord:
    """One registered adapter, as the catalog stores it."""

    id: str
    """Stable id, also the blob's file name."""
    name: str
    """Unique per owner."""
    owner: str
    """Owner tenant."""
    visibility: int
    """``PRIVATE`` (1) or ``PUBLIC`` (2), the proto enum's values."""
    base_model: str
    """Base model tag the adapter was validated against."""
    pet_type: str
    """Kind of fine-tune; ``lora``."""
    rank: int
    """The config's ``r``."""
    max_rank: int
    """Largest rank over ``rank_pattern``."""
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    dtype: str
    size_bytes: int
    """Bytes of the safetensors blob."""
    sha256: str
    """Hex digest of the safetensors blob."""
    version: int
    """1 for the first registration of ``(owner, name)``; +1 each time it is registered again."""
    created_ms: int
    config_json: str
    """``adapter_config.json`` as uploaded."""
    chat_template: str = ""
    """Its own chat template, uploaded with it; "": the base model's."""
    tool_use_chat_template: str = ""
    """Its own chat template for requests that offer tools; "": :attr:`chat_template`."""
    pinned: bool = False
    """Never evicted from the store's RAM tier, the workers' host caches or their pools
    (``SetAdapterPinned``); a new version of the name keeps it."""


_COLUMNS = [f for f in AdapterRecord.__dataclass_fields__]


def _row_to_record(row: sqlite3.Row) -> AdapterRecord:
    values = {c: row[c] for c in _COLUMNS}
    values["use_rslora"] = bool(values["use_rslora"])
    values["pinned"] = bool(values["pinned"])
    values["target_modules"] = tuple(json.loads(values["target_modules"]))
    return AdapterRecord(**values)


class DuplicateName(Exception):
    """``(owner, name)`` is already registered."""


class Catalog:
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

    def set_pinned(self, adapter_id: str, pinned: bool) -> bool:
        """Pin or unpin one adapter; False when there is no such adapter (any more)."""
        with self._lock:
            cursor = self._db.execute("UPDATE adapters SET pinned=? WHERE id=?", (int(pinned), adapter_id))
        return cursor.rowcount > 0

    def pinned_sizes(self) -> dict[str, int]:
        """``{id: size_bytes}`` of every pinned adapter."""
        with self._read_lock:
            rows = self._reader.execute("SELECT id, size_bytes FROM adapters WHERE pinned=1").fetchall()
        return {row["id"]: row["size_bytes"] for row in rows}

    def get(self, adapter_id: str) -> AdapterRecord | None:
        with self._read_lock:
            row = self._reader.execute("SELECT * FROM adapters WHERE id=?", (adapter_id,)).fetchone()
        return _row_to_record(row) if row else None

    def get_by_name(self, owner: str, name: str) -> AdapterRecord | None:
        with self._read_lock:
            row = self._reader.execute(
                "SELECT * FROM adapters WHERE owner=? AND name=?", (owner, name)
            ).fetchone()
        return _row_to_record(row) if row else None

    def page(
        self, owner: str | None, include_public: bool, after_seq: int, limit: int
    ) -> tuple[list[tuple[int, AdapterRecord]], int]:
        """``(seq, record)`` pairs after ``after_seq`` in registration order, and the total matching."""
        where, params = "1=1", []
        if owner:
            if include_public:
                where, params = "(owner=? OR visibility=?)", [owner, PUBLIC]
            else:
                where, params = "owner=?", [owner]
        with self._read_lock:
            self._reader.execute("BEGIN")  # one snapshot for the page and its total
            try:
                rows = self._reader.execute(
                    f"SELECT * FROM adapters WHERE {where} AND seq > ? ORDER BY seq LIMIT ?",
                    [*params, after_seq, limit],
                ).fetchall()
                total = self._reader.execute(
                    f"SELECT COUNT(*) FROM adapters WHERE {where}", params
                ).fetchone()[0]
            finally:
                self._reader.execute("COMMIT")
        return [(r["seq"], _row_to_record(r)) for r in rows], total

    def all(self) -> list[AdapterRecord]:
        with self._read_lock:
            rows = self._reader.execute("SELECT * FROM adapters ORDER BY seq").fetchall()
        return [_row_to_record(r) for r in rows]

    def count(self) -> int:
        with self._read_lock:
            return self._reader.execute("SELECT COUNT(*) FROM adapters").fetchone()[0]
