"""The adapter repository (PetS's parameter repository, S-LoRA's host-memory adapter store).

Combines the catalog (source of truth), the blob files and the RAM tier. Every operation is
synchronous and may block on disk: the servicer runs them in a worker thread.

Registration order is what makes it crash-safe: validate everything in memory (while the weights
are written to a temp file and flushed, :mod:`services.adapter_store.blob_writes`), make the blob
durable (rename, directory fsync), then commit the catalog row; the directory
fsync and the commit are shared by the registrations that finish together (group commit), and
a registration is acknowledged only once both are done. A crash before the commit leaves an
orphan blob that :meth:`AdapterRepository.open` removes; a reader never sees an adapter whose
bytes are not all on disk.

Reopening does not read the blobs (by default it checks their sizes): a blob's sha256 is checked
when it is first read from disk, before any of its bytes are served, so a restart takes the same
time with 10 or 10,000 adapters.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import re
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

from services.adapter_store.blob_store import BlobStore, sha256_hex
from services.adapter_store.blob_writes import BlobWrites, PendingBlob
from services.adapter_store.catalog import PRIVATE, PUBLIC, AdapterRecord, Catalog, DuplicateName
from services.adapter_store.catalog_changes import CatalogChange, CatalogChanges
from services.adapter_store.chat_templates import read_chat_templates
from services.adapter_store.group_commit import GroupCommit
from services.adapter_store.ram_tier import RamTier
from services.adapter_store.validation import ValidationLimits, validate_adapter
from services.model_files.base_model import BaseModelSpec
from services.runtime.errors import AlreadyExists, DataLoss, InvalidArgument, NotFound, ResourceExhausted
from services.runtime.eviction import make_eviction_policy
from services.runtime.private_files import private_dir

log = logging.getLogger("loramesh.adapter_store")

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 100


@dataclass(frozen=True)
class AdapterKey:
    """Names an adapter by ``id``, or by ``owner`` and ``name``."""

    id: str = ""
    owner: str = ""
    name: str = ""


@dataclass(frozen=True)
class OpenReport:
    """What start-up found on disk."""

    adapters: int
    """Adapters in the catalog whose blobs passed verification."""
    orphan_blobs_removed: int
    temp_files_removed: int
    corrupt_quarantined: int


@dataclass(frozen=True)
class RepositoryStats:
    adapters: int
    disk_bytes: int
    ram_bytes: int
    ram_budget_bytes: int
    ram_adapters: int
    ram_hits: int
    ram_misses: int


@dataclass(frozen=True)
class AdapterRegistration:
    """What registering content under a name did."""

    record: AdapterRecord
    """The adapter the name now serves."""
    changed: bool
    """False: the name already held this very content (weights, config, templates, visibility),
    which was kept as it was, same id and version."""


def check_name(field: str, value: str) -> None:
    if not _NAME_RE.fullmatch(value or ""):
        raise InvalidArgument(
            f"{field} {value!r} is invalid: 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )


def encode_page_token(seq: int) -> str:
    return base64.urlsafe_b64encode(f"seq:{seq}".encode()).decode()


def decode_page_token(token: str) -> int:
    if not token:
        return 0
    try:
        text = base64.urlsafe_b64decode(token.encode()).decode()
        if not text.startswith("seq:"):
            raise ValueError(text)
        return int(text[4:])
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise InvalidArgument(f"page_token {token!r} is not a token this store issued") from None


class AdapterRepository:
    def __init__(
        self,
        data_dir: Path,
        spec: BaseModelSpec,
        limits: ValidationLimits,
        ram_budget_bytes: int,
        verify_on_open: str = "size",
        eviction_policy: str = "lru",
    ):
        """``verify_on_open``: what :meth:`open` checks of every blob: ``size`` (a ``stat``; each
        blob's sha256 is checked when it is first read from disk, before any byte is served) or
        ``sha256`` (every blob read and hashed before the store serves).
        ``eviction_policy``: the RAM tier's order of eviction (services/runtime/eviction.py)."""
        if verify_on_open not in ("sha256", "size"):
            raise ValueError(f"verify_on_open must be 'sha256' or 'size', not {verify_on_open!r}")
        self.data_dir = Path(data_dir)
        self.spec = spec
        self.limits = limits
        self.verify_on_open = verify_on_open
        self.blobs = BlobStore(self.data_dir)
        self.catalog = Catalog(self.data_dir / "catalog.sqlite3")
        self.ram = RamTier(ram_budget_bytes, make_eviction_policy(eviction_policy))
        self._pin_lock = threading.Lock()
        self._quarantine = self.data_dir / "quarantine"
        self._disk_bytes = 0
        self._disk_lock = threading.Lock()
        self.changes = CatalogChanges()
        """Every committed change of the catalog, in commit order (``WatchAdapters``)."""
        # Held from a catalog change's commit to its publication: changes publish in commit order.
        self._change_lock = threading.Lock()
        self._commits: GroupCommit[tuple[AdapterRecord, str]] = GroupCommit(self._commit_batch)
        self._blob_writes = BlobWrites(self.blobs)

    def open(self) -> OpenReport:
        """Reload the catalog and reconcile it with the blobs on disk."""
        temp_removed = self.blobs.clean_temp()
        records = self.catalog.all()
        on_disk = self.blobs.ids()
        known = {r.id for r in records}
        orphans = on_disk - known
        for blob_id in orphans:
            self.blobs.delete(blob_id)
        corrupt = 0
        disk_bytes = 0
        for record in records:
            problem = self._verify_blob(record)
            if problem:
                corrupt += 1
                log.error("adapter %s (%s/%s) %s: quarantined", record.id, record.owner, record.name, problem)
                self._quarantine_blob(record)
            else:
                disk_bytes += record.size_bytes
        self._disk_bytes = disk_bytes
        self._restore_pins()
        report = OpenReport(
            adapters=len(records) - corrupt,
            orphan_blobs_removed=len(orphans),
            temp_files_removed=temp_removed,
            corrupt_quarantined=corrupt,
        )
        log.info("catalog opened: %s", report)
        return report

    def close(self) -> None:
        self._blob_writes.close()
        self.catalog.close()

    def _restore_pins(self) -> None:
        """Pin the catalog's pinned adapters in the RAM tier (kept there once read)."""
        pinned = self.catalog.pinned_sizes()
        for adapter_id in pinned:
            self.ram.pin(adapter_id)
        if sum(pinned.values()) > self.ram.budget_bytes:
            log.warning(
                "the %d pinned adapters take %d bytes, over the RAM budget of %d bytes: those that "
                "do not fit are read from disk; unpin some or raise --ram-budget-mib",
                len(pinned), sum(pinned.values()), self.ram.budget_bytes,
            )  # fmt: skip

    def _verify_blob(self, record: AdapterRecord) -> str | None:
        try:
            size = self.blobs.path(record.id).stat().st_size
        except FileNotFoundError:
            return "blob missing"
        if size != record.size_bytes:
            return f"blob has {size} bytes, catalog says {record.size_bytes}"
        if self.verify_on_open == "sha256" and sha256_hex(self.blobs.read(record.id)) != record.sha256:
            return "blob sha256 mismatch"
        return None

    def _quarantine_blob(self, record: AdapterRecord) -> bool:
        """Move the blob aside and drop its row; False if another caller did first."""
        private_dir(self._quarantine)
        path = self.blobs.path(record.id)
        with contextlib.suppress(FileNotFoundError):
            path.rename(self._quarantine / path.name)
        return self._delete_row(record.id)

    def _delete_row(self, adapter_id: str) -> bool:
        with self._change_lock:
            deleted = self.catalog.delete(adapter_id)
            if deleted:
                self.changes.publish(CatalogChange(deleted_id=adapter_id))
        return deleted

    def register(
        self,
        name: str,
        owner: str,
        visibility: int,
        config_bytes: bytes,
        weights: bytes,
        tokenizer_files: Mapping[str, bytes] = MappingProxyType({}),
    ) -> AdapterRecord:
        """Validate, store durably and commit one adapter. Nothing is kept if any step fails.

        ``tokenizer_files``: the uploaded tokenizer files by name, whose chat template the
        adapter is served with (:mod:`services.adapter_store.chat_templates`).
        """
        check_name("name", name)
        check_name("owner", owner)
        if self.catalog.get_by_name(owner, name) is not None:
            raise AlreadyExists(f"adapter {name!r} already exists for owner {owner!r}")
        written = self._blob_writes.start(weights)
        record = self._validated_record(
            written, name, owner, visibility, config_bytes, weights, tokenizer_files
        )
        self._commit(record, weights, written)
        return record

    def register_version(
        self,
        name: str,
        owner: str,
        visibility: int,
        config_bytes: bytes,
        weights: bytes,
        tokenizer_files: Mapping[str, bytes] = MappingProxyType({}),
    ) -> AdapterRegistration:
        """As :meth:`register`, but a name already registered is not refused: the same content
        is kept as it is, other content replaces it as the next version (a new id, so no cache
        keyed by id serves the old weights under it). What an import does."""
        check_name("name", name)
        check_name("owner", owner)
        current = self.catalog.get_by_name(owner, name)
        # A name already registered is most often imported again unchanged: its weights are
        # written only once they are known to differ.
        written = self._blob_writes.start(weights) if current is None else None
        record = self._validated_record(
            written, name, owner, visibility, config_bytes, weights, tokenizer_files
        )
        if current is not None and _content(current) == _content(record):
            return AdapterRegistration(current, changed=False)
        if current is not None:
            record = replace(record, pinned=current.pinned)  # a pin is the name's, not a version's
        self._commit(record, weights, written or self._blob_writes.start(weights), replacing=current)
        return AdapterRegistration(record, changed=True)

    def _validated_record(
        self,
        written: PendingBlob | None,
        name: str,
        owner: str,
        visibility: int,
        config_bytes: bytes,
        weights: bytes,
        tokenizer_files: Mapping[str, bytes],
    ) -> AdapterRecord:
        """The record of a valid adapter. When anything fails, ``written`` (the write of its
        weights, if started) is discarded before the error goes on."""
        if visibility not in (PRIVATE, PUBLIC):
            visibility = PRIVATE
        try:
            validated = validate_adapter(config_bytes, weights, self.spec, self.limits)
            templates = read_chat_templates(tokenizer_files)
            return AdapterRecord(
                id=uuid.uuid4().hex,
                name=name,
                owner=owner,
                visibility=visibility,
                base_model=self.spec.name,
                pet_type="lora",
                rank=validated.config.rank,
                max_rank=validated.max_rank,
                lora_alpha=validated.config.alpha,
                use_rslora=validated.config.use_rslora,
                target_modules=tuple(validated.target_modules),
                dtype=validated.dtype,
                size_bytes=len(weights),
                sha256=sha256_hex(weights),
                version=self.catalog.next_version(owner, name),
                created_ms=int(time.time() * 1000),
                config_json=config_bytes.decode("utf-8"),
                chat_template=templates.chat_template,
                tool_use_chat_template=templates.tool_use_chat_template,
            )
        except BaseException:
            if written is not None:
                written.discard()
            raise

    def _commit(
        self,
        record: AdapterRecord,
        weights: bytes,
        written: PendingBlob,
        replacing: AdapterRecord | None = None,
    ) -> None:
        """Blob first (``written``, the weights' file, published as ``record``'s blob), then the
        catalog row (in place of ``replacing``'s), then the old blob goes.

        The blob directory's flush and the row's commit are shared with the registrations
        committing at the same time (:mod:`services.adapter_store.group_commit`); this returns
        once both are durable.

        Only a pinned adapter goes into the RAM tier here: the others enter it when first
        fetched, so registering thousands does not evict the adapters in use."""
        written.publish(record.id)
        try:
            self._commits.submit((record, replacing.id if replacing else ""))
        except DuplicateName:
            self.blobs.delete(record.id)
            raise AlreadyExists(
                f"adapter {record.name!r} already exists for owner {record.owner!r}"
            ) from None
        except BaseException:
            self.blobs.delete(record.id)
            raise
        with self._disk_lock:
            self._disk_bytes += record.size_bytes
        if record.pinned:
            self.ram.pin(record.id)
            self.ram.put(record.id, weights)
        if replacing is not None:
            self.blobs.delete(replacing.id)
            self.ram.discard(replacing.id)
            self.ram.unpin(replacing.id)
            with self._disk_lock:
                self._disk_bytes -= replacing.size_bytes

    def _commit_batch(self, entries: Sequence[tuple[AdapterRecord, str]]) -> list[DuplicateName | None]:
        """One group of registrations: their blobs' renames made durable, then their rows
        committed in one transaction and published."""
        self.blobs.sync_dir()
        with self._change_lock:
            results = self.catalog.insert_many(entries)
            for (record, replacing), result in zip(entries, results, strict=True):
                if result is None:
                    if replacing:
                        self.changes.publish(CatalogChange(deleted_id=replacing))
                    self.changes.publish(CatalogChange(upserted=record))
        return results

    def resolve(self, key: AdapterKey) -> AdapterRecord:
        if key.id:
            record = self.catalog.get(key.id)
            if record is None:
                raise NotFound(f"adapter id {key.id!r} not found")
            return record
        if not key.name:
            raise InvalidArgument("ref must give an adapter id or an owner and name")
        record = self.catalog.get_by_name(key.owner, key.name)
        if record is None:
            raise NotFound(f"adapter {key.name!r} of owner {key.owner!r} not found")
        return record

    def list(
        self, owner: str = "", include_public: bool = False, page_size: int = 0, page_token: str = ""
    ) -> tuple[list[AdapterRecord], str, int]:
        """One page: (records, next page token or "", total matching)."""
        if page_size > MAX_PAGE_SIZE:
            raise InvalidArgument(f"page_size {page_size} is above the maximum {MAX_PAGE_SIZE}")
        limit = page_size or DEFAULT_PAGE_SIZE
        after = decode_page_token(page_token)
        rows, total = self.catalog.page(owner or None, include_public, after, limit + 1)
        more = len(rows) > limit
        rows = rows[:limit]
        next_token = encode_page_token(rows[-1][0]) if more else ""
        return [record for _, record in rows], next_token, total

    def delete(self, key: AdapterKey) -> AdapterRecord:
        """Remove from the catalog first (invisible at once), then the blob and RAM copy."""
        record = self.resolve(key)
        if self._delete_row(record.id):
            self.blobs.delete(record.id)
            self.ram.discard(record.id)
            self.ram.unpin(record.id)
            with self._disk_lock:
                self._disk_bytes -= record.size_bytes
        return record

    def set_pinned(self, key: AdapterKey, pinned: bool) -> AdapterRecord:
        """Pin (or unpin) an adapter: it is read into the RAM tier, which never evicts it, and the
        workers keep it too (they read :meth:`pinned_ids`). Pinned adapters count against the RAM
        budget: ResourceExhausted, pinning nothing, when they would not fit in it all together."""
        with self._pin_lock:
            record = self.resolve(key)
            if pinned == record.pinned:
                return record
            if not pinned:
                found = self.catalog.set_pinned(record.id, False)
                self.ram.unpin(record.id)
            else:
                pinned_bytes = sum(self.catalog.pinned_sizes().values()) + record.size_bytes
                if pinned_bytes > self.ram.budget_bytes:
                    raise ResourceExhausted(
                        f"pinning adapter {record.name!r} of owner {record.owner!r} ({record.size_bytes} "
                        f"bytes) would pin {pinned_bytes} bytes, over the store's RAM budget of "
                        f"{self.ram.budget_bytes} bytes (--ram-budget-mib): unpin another adapter first"
                    )
                self.ram.pin(record.id)
                found = False
                try:
                    self.read_weights(record)  # hot from now on
                    found = self.catalog.set_pinned(record.id, True)
                finally:
                    if not found:  # unreadable or deleted meanwhile: nothing pinned
                        self.ram.unpin(record.id)
            if not found:
                raise NotFound(f"adapter id {record.id!r} was deleted")
            return replace(record, pinned=pinned)

    def pinned_ids(self) -> list[str]:
        """The ids of every pinned adapter."""
        return list(self.catalog.pinned_sizes())

    def read_weights(self, record: AdapterRecord) -> memoryview:
        """The safetensors bytes (read-only): from RAM if hot, else from disk, verified against
        the catalog's sha256 before it is cached or served. A blob that fails is quarantined
        (its row removed, as :meth:`open` does with ``verify_on_open="sha256"``): DataLoss."""
        data = self.ram.get(record.id)
        if data is not None:
            return data
        try:
            data = self.blobs.read(record.id)
        except FileNotFoundError:
            if self.catalog.get(record.id) is None:
                raise NotFound(f"adapter id {record.id!r} was deleted") from None
            raise DataLoss(f"adapter {record.id!r}: blob missing on disk") from None
        if sha256_hex(data) != record.sha256:
            log.error(
                "adapter %s (%s/%s) blob sha256 mismatch: quarantined", record.id, record.owner, record.name
            )
            if self._quarantine_blob(record):
                with self._disk_lock:
                    self._disk_bytes -= record.size_bytes
            raise DataLoss(f"adapter {record.id!r}: blob on disk fails its sha256 check; quarantined")
        self.ram.put(record.id, data)
        return data

    def stats(self) -> RepositoryStats:
        return RepositoryStats(
            adapters=self.catalog.count(),
            disk_bytes=self._disk_bytes,
            ram_bytes=self.ram.bytes_used,
            ram_budget_bytes=self.ram.budget_bytes,
            ram_adapters=len(self.ram),
            ram_hits=self.ram.hits,
            ram_misses=self.ram.misses,
        )


def _content(record: AdapterRecord) -> tuple:
    """What a registration serves: weights, config, chat templates, visibility."""
    return (
        record.sha256,
        record.config_json,
        record.chat_template,
        record.tool_use_chat_template,
        record.visibility,
    )
