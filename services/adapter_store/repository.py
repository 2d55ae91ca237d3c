"""The adapter repository (PetS's parameter repository, S-LoRA's host-memory adapter store).

Combines the catalog (source of truth), the blob files and the RAM tier. Every operation is
synchronous and may block on disk: the servicer runs them in a worker thread.

Registration (validation, the durable blob write, the group commit) is
:class:`services.adapter_store.registrar.AdapterRegistrar`'s, reached as ``repository.registrar``.

Reopening does not read the blobs (by default it checks their sizes): a blob's sha256 is checked
when it is first read from disk, before any of its bytes are served, so a restart takes the same
time with 10 or 10,000 adapters.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from services.adapter_store.blob_store import BlobStore, sha256_hex
from services.adapter_store.catalog import AdapterRecord, Catalog
from services.adapter_store.catalog_changes import CatalogChange, CatalogChanges
from services.adapter_store.ram_tier import RamTier
from services.adapter_store.registrar import AdapterRegistrar
from services.adapter_store.validation import ValidationLimits
from services.model_files.base_model import BaseModelSpec
from services.runtime.errors import DataLoss, InvalidArgument, NotFound, ResourceExhausted
from services.runtime.eviction import make_eviction_policy
from services.runtime.security.private_files import private_dir

log = logging.getLogger("loramesh.adapter_store")

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
        self.registrar = AdapterRegistrar(
            spec,
            limits,
            self.blobs,
            self.catalog,
            self.ram,
            self.changes,
            self._change_lock,
            self._count_disk_bytes,
        )

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
        self.registrar.close()
        self.catalog.close()

    def _count_disk_bytes(self, delta: int) -> None:
        with self._disk_lock:
            self._disk_bytes += delta

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
            self._count_disk_bytes(-record.size_bytes)
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
                self._count_disk_bytes(-record.size_bytes)
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
