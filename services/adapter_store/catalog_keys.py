"""Where the adapter catalog lives in etcd, and how a row is written there.

Keys, under ``<key_prefix>/adapter_store``::

    rows/<id>                 -> the row (JSON, :func:`encode_row`); its create revision orders
                                 the listing (``seq``)
    names/<owner>/<name>      -> id of the adapter the name serves now
    versions/<owner>/<name>   -> last version given to the name (kept after a delete)
    refs/<sha256>/<id>        -> "" : row ``id`` references blob ``sha256``
    blobs/<sha256>            -> the collector's state of a blob (JSON, :class:`BlobMark`);
                                 absent until the collector first looks at it
    usage/<owner>/<id>        -> bytes row ``id`` stores for its owner (decimal): the keys of an
                                 owner are what it stores, counted against its quota
                                 (:mod:`.storage_usage`)
    uploads/<owner>/<slot>    -> the replica and upload holding one of the owner's
                                 ``max_concurrent_uploads`` slots, under that replica's lease
                                 (:mod:`.upload_slots`)

Rows are small: the adapter config and chat templates are blobs named by their sha256, like the
weights, and a row holds their digests. Uniqueness of a name, its versions and the safety of
collecting blobs all rest on etcd transactions over these keys (:mod:`.catalog`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

from services.adapter_store.adapter_record import AdapterRecord
from services.runtime.etcd.adapter_catalog_rows import catalog_root

_TEXT_FIELDS = ("config_json", "chat_template", "tool_use_chat_template")
"""Record fields kept as blobs, the row holding ``<field>_sha256`` instead."""
_ROW_FIELDS = tuple(f.name for f in fields(AdapterRecord) if f.name not in _TEXT_FIELDS)


def text_digest(text: str) -> str:
    """The blob name of a text part; "" for an empty text (no blob)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest() if text else ""


@dataclass(frozen=True)
class CatalogKeys:
    """The catalog's keys under one root."""

    root: str
    """``<key_prefix>/adapter_store``."""

    @classmethod
    def under(cls, key_prefix: str) -> CatalogKeys:
        return cls(catalog_root(key_prefix))

    @property
    def rows(self) -> str:
        return f"{self.root}/rows/"

    def row(self, adapter_id: str) -> str:
        return self.rows + adapter_id

    def name(self, owner: str, name: str) -> str:
        return f"{self.root}/names/{owner}/{name}"

    def version(self, owner: str, name: str) -> str:
        return f"{self.root}/versions/{owner}/{name}"

    def refs(self, digest: str) -> str:
        """The prefix of ``digest``'s references."""
        return f"{self.root}/refs/{digest}/"

    def ref(self, digest: str, adapter_id: str) -> str:
        return self.refs(digest) + adapter_id

    def blob_mark(self, digest: str) -> str:
        return f"{self.root}/blobs/{digest}"

    def usage(self, owner: str) -> str:
        """The prefix of ``owner``'s usage entries."""
        return f"{self.root}/usage/{owner}/"

    def usage_entry(self, owner: str, adapter_id: str) -> str:
        return self.usage(owner) + adapter_id

    @property
    def all_usage(self) -> str:
        """The prefix of every owner's usage entries."""
        return f"{self.root}/usage/"

    def upload_slots(self, owner: str) -> str:
        """The prefix of ``owner``'s upload slots."""
        return f"{self.root}/uploads/{owner}/"

    def row_id(self, key: bytes | str) -> str:
        text = key.decode() if isinstance(key, bytes) else key
        return text[len(self.rows) :]


def record_digests(record: AdapterRecord) -> dict[str, str]:
    """``{field: sha256}`` of every blob ``record`` references (its weights, config and
    non-empty templates)."""
    digests = {"sha256": record.sha256}
    for field in _TEXT_FIELDS:
        digest = text_digest(getattr(record, field))
        if digest:
            digests[f"{field}_sha256"] = digest
    return digests


def record_texts(record: AdapterRecord) -> dict[str, bytes]:
    """``{sha256: bytes}`` of the record's text parts that are blobs."""
    return {
        text_digest(getattr(record, field)): getattr(record, field).encode("utf-8")
        for field in _TEXT_FIELDS
        if getattr(record, field)
    }


def encode_row(record: AdapterRecord) -> bytes:
    row = {name: getattr(record, name) for name in _ROW_FIELDS}
    row["target_modules"] = list(record.target_modules)
    row.update(record_digests(record))
    return json.dumps(row, separators=(",", ":")).encode()


def row_digests(raw: bytes) -> dict[str, str]:
    """The blob digests a row holds, by field (without reading the blobs)."""
    row = json.loads(raw)
    return {"sha256": row["sha256"]} | {f"{f}_sha256": d for f, d in _text_digests(row).items()}


def _text_digests(row: dict) -> dict[str, str]:
    return {field: row[f"{field}_sha256"] for field in _TEXT_FIELDS if row.get(f"{field}_sha256")}


def text_digests(row: dict) -> list[str]:
    """The digests of a parsed row's text parts (config, chat templates)."""
    return list(_text_digests(row).values())


def decode_row(raw: bytes, read_text) -> AdapterRecord:
    """The record a row stands for; ``read_text(sha256) -> str`` reads a text part's blob."""
    return record_of_row(json.loads(raw), read_text)


def record_of_row(row: dict, read_text) -> AdapterRecord:
    """:func:`decode_row` of a row already parsed."""
    values = {name: row[name] for name in _ROW_FIELDS if name in row}
    values["target_modules"] = tuple(row["target_modules"])
    texts = _text_digests(row)
    for field in _TEXT_FIELDS:
        values[field] = read_text(texts[field]) if field in texts else ""
    return AdapterRecord(**values)


@dataclass(frozen=True)
class BlobMark:
    """What the collector is doing with a blob (``blobs/<sha256>``)."""

    state: str
    """``collecting``: a collector found it unreferenced and may be deleting it now;
    ``collected``: it was deleted (a registration may write it again)."""
    since_ms: int
    """When the state was set: a ``collecting`` mark older than the collector's stall limit is
    taken as abandoned."""
    by: str = ""
    """The replica that set it."""

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> BlobMark:
        return cls(**json.loads(raw))
