"""The adapter repository (PetS's parameter repository, S-LoRA's host-memory adapter store).

Combines the catalog (in etcd, the source of truth every replica shares), the blob tier (a local
directory or an S3 bucket, content-addressed) and the RAM tier in front of it. Every operation
is synchronous and may block on disk, network or etcd: the servicer runs them in worker threads.

Registration (validation, the durable blob write, the group commit) is
:class:`services.adapter_store.registrar.AdapterRegistrar`'s, reached as ``repository.registrar``.

Reopening does not read the blobs (by default it lists them once and checks their sizes): a
blob's sha256 is checked when it is first read, before any of its bytes are served, so a restart
takes about the same time with 10 or 10,000 adapters.
"""

from __future__ import annotations

import base64
import binascii
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from services.adapter_store.adapter_record import AdapterRecord
from services.adapter_store.blob_collector import BlobCollector
from services.adapter_store.blobs.backend import BlobBackend, BlobMissing
from services.adapter_store.catalog import Catalog
from services.adapter_store.catalog_changes import CatalogChange
from services.adapter_store.catalog_mirror import Seq
from services.adapter_store.ram_tier import RamTier
from services.adapter_store.registrar import AdapterRegistrar, sha256_hex
from services.adapter_store.tenant_storage_quota import TenantStorageQuota
from services.adapter_store.upload_slots import UploadSlots
from services.adapter_store.validation import ValidationLimits
from services.adapter_store.version_retention import VersionRetention
from services.model_files.base_model import BaseModelSpec
from services.runtime.errors import DataLoss, InvalidArgument, NotFound, ResourceExhausted
from services.runtime.etcd.membership import MembershipConfig
from services.runtime.eviction import make_eviction_policy
from services.runtime.tenants_file import QuotaConfig

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
    """Blobs no row references, older than the collector's grace period."""
    temp_files_removed: int
    """Staged writes abandoned by a crash, older than the same grace period."""
    corrupt_quarantined: int
    """Adapters removed because their weights blob was missing or did not match."""


@dataclass(frozen=True)
class RepositoryStats:
    adapters: int
    disk_bytes: int
    ram_bytes: int
    ram_budget_bytes: int
    ram_adapters: int
    ram_hits: int
    ram_misses: int


def encode_page_token(seq: Seq) -> str:
    return base64.urlsafe_b64encode(f"seq:{seq[0]}:{seq[1]}".encode()).decode()


def decode_page_token(token: str) -> Seq:
    """The place after which the next page starts (a token of the single-replica store, which
    has no id part, is refused: its listing is gone)."""
    if not token:
        return (0, "")
    try:
        text = base64.urlsafe_b64decode(token.encode()).decode()
        revision, _, adapter_id = text.removeprefix("seq:").partition(":")
        if not text.startswith("seq:") or not adapter_id:
            raise ValueError(text)
        return (int(revision), adapter_id)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise InvalidArgument(f"page_token {token!r} is not a token this store issued") from None


@dataclass(frozen=True)
class RepositorySettings:
    """How a repository keeps and checks what it stores."""

    ram_budget_bytes: int = 64 << 20
    """Bytes of adapter weights kept hot in RAM, pinned adapters included."""
    verify_on_open: str = "size"
    """What :meth:`AdapterRepository.open` checks of every weights blob: ``size`` (one listing;
    each blob's sha256 is checked when it is first read, before any byte is served) or ``sha256``
    (every blob read and hashed before the store serves)."""
    eviction_policy: str = "lru"
    """The RAM tier's order of eviction (services/runtime/eviction.py)."""
    collect_grace_s: float = 3600.0
    """Blobs no row references and staged writes are removed only once older than this: longer
    than any registration takes between writing its blob and committing its row."""
    replica_id: str = "adapter_store"
    """This replica's name in the collector's marks and the logs."""
    keep_versions: int = 4
    """Versions of each name kept, the serving one counted (:mod:`.version_retention`); 1: a new
    version removes the one it replaces (unless ``keep_versions_s``)."""
    keep_versions_s: float = 0.0
    """Seconds a replaced version is kept at least, beyond ``keep_versions``."""
    tenants: QuotaConfig = field(default_factory=QuotaConfig)
    """The tenants' limits (the tenants file's ``"tenants"``): what each may store and upload at
    once (:mod:`services.adapter_store.tenant_storage_quota`)."""

    def __post_init__(self) -> None:
        if self.verify_on_open not in ("sha256", "size"):
            raise ValueError(f"verify_on_open must be 'sha256' or 'size', not {self.verify_on_open!r}")


class AdapterRepository:
    def __init__(
        self,
        blobs: BlobBackend,
        catalog_config: MembershipConfig,
        spec: BaseModelSpec,
        limits: ValidationLimits,
        settings: RepositorySettings = RepositorySettings(),
        *,
        clock: Callable[[], float] = time.time,
    ):
        """``clock``: Unix seconds, for the ages of blobs and staged writes (injected by tests)."""
        self.blobs = blobs
        self.spec = spec
        self.limits = limits
        self.settings = settings
        self.catalog = Catalog(catalog_config, self._read_text, settings.replica_id, blobs.flush)
        self.changes = self.catalog.changes
        """Every committed change of the catalog, in commit order (``WatchAdapters``)."""
        self.ram = RamTier(settings.ram_budget_bytes, make_eviction_policy(settings.eviction_policy))
        self.collector = BlobCollector(self.catalog, blobs, settings.collect_grace_s, clock)
        self._clock = clock
        self._pin_lock = threading.Lock()
        self.upload_slots = UploadSlots(
            self.catalog.keys, self.catalog.etcd_call, settings.replica_id, catalog_config.ttl_s
        )
        self.quota = TenantStorageQuota(settings.tenants, self.catalog.usage, self.upload_slots)
        self.retention = VersionRetention(
            self.catalog.keys,
            self.catalog.mirror,
            self.catalog.etcd_call,
            settings.keep_versions,
            settings.keep_versions_s,
            clock,
        )
        self.registrar = AdapterRegistrar(
            spec,
            limits,
            blobs,
            self.catalog,
            self.ram,
            quota=self.quota,
            withdraw=self.collector.remove,
            retention=self.retention,
        )

    def _read_text(self, digest: str) -> str:
        """A row's text part (config, chat template), checked against its digest."""
        data = self.blobs.get(digest)
        if sha256_hex(data) != digest:
            raise DataLoss(f"text blob {digest} fails its sha256 check")
        return bytes(data).decode("utf-8")

    def open(self) -> OpenReport:
        """Read the catalog and reconcile it with the blob tier."""
        self.catalog.open()
        self.changes.subscribe(self._follow_pins)
        temp_removed = self.blobs.collect_staging(self.settings.collect_grace_s, self._clock())
        records = self.catalog.all()
        listing = list(self.blobs.listing())  # once: 10,000 stats took 0.4 s under load
        sizes = {entry.digest: entry.size for entry in listing}
        corrupt, served = 0, []
        for record in records:
            size = sizes.get(record.sha256)
            problem = self._verify_blob(record, size)
            if problem:
                corrupt += 1
                log.error("adapter %s (%s/%s) %s: quarantined", record.id, record.owner, record.name, problem)
                self._quarantine(record, corrupt_blob=size is not None)
            else:
                served.append(record)
        self.catalog.reconcile_usage()
        orphans = self.collector.collect(listing)
        self._restore_pins(served)
        report = OpenReport(
            adapters=len(records) - corrupt,
            orphan_blobs_removed=orphans,
            temp_files_removed=temp_removed,
            corrupt_quarantined=corrupt,
        )
        log.info("catalog opened (blobs: %s): %s", self.blobs.description, report)
        return report

    def close(self) -> None:
        self.upload_slots.close()
        self.catalog.close()
        self.blobs.close()

    def _restore_pins(self, records: list[AdapterRecord]) -> None:
        """Pin the pinned adapters of ``records`` (the catalog's, as opened) in the RAM tier
        (kept there once read)."""
        pinned = [record for record in records if record.pinned]
        for record in pinned:
            self.ram.pin(record.sha256)
        pinned_bytes = sum(record.size_bytes for record in pinned)
        if pinned_bytes > self.ram.budget_bytes:
            log.warning(
                "the %d pinned adapters take %d bytes, over the RAM budget of %d bytes: those that "
                "do not fit are read from the blob tier; unpin some or raise --ram-budget-mib",
                len(pinned), pinned_bytes, self.ram.budget_bytes,
            )  # fmt: skip

    def _follow_pins(self, change: CatalogChange) -> None:
        """Pins set on other replicas reach this one's RAM tier."""
        record = change.upserted
        if record is not None:
            if record.pinned:
                self.ram.pin(record.sha256)
            elif self.ram.is_pinned(record.sha256) and not self._pinned_elsewhere(record):
                self.ram.unpin(record.sha256)  # the common case (nothing pinned) scans nothing

    def _pinned_elsewhere(self, record: AdapterRecord) -> bool:
        return any(r.pinned and r.sha256 == record.sha256 and r.id != record.id for r in self.catalog.all())

    def _verify_blob(self, record: AdapterRecord, size: int | None) -> str | None:
        if size is None:
            return "blob missing"
        if size != record.size_bytes:
            return f"blob has {size} bytes, catalog says {record.size_bytes}"
        if (
            self.settings.verify_on_open == "sha256"
            and sha256_hex(self.blobs.get(record.sha256)) != record.sha256
        ):
            return "blob sha256 mismatch"
        return None

    def _quarantine(self, record: AdapterRecord, corrupt_blob: bool) -> None:
        """Drop the row of an adapter whose weights are lost or corrupt, and its blob when it is
        there but corrupt (so registering the same weights again writes them afresh)."""
        self.catalog.delete(record)
        self.ram.discard(record.sha256)
        if corrupt_blob:
            self.blobs.delete(record.sha256)

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
        self,
        owner: str = "",
        include_public: bool = False,
        page_size: int = 0,
        page_token: str = "",
        kept: bool = False,
    ) -> tuple[list[AdapterRecord], str, int]:
        """One page: (records, next page token or "", total matching); the serving version of
        each name, and its kept versions too with ``kept`` (what a watcher's copy holds)."""
        if page_size > MAX_PAGE_SIZE:
            raise InvalidArgument(f"page_size {page_size} is above the maximum {MAX_PAGE_SIZE}")
        limit = page_size or DEFAULT_PAGE_SIZE
        after = decode_page_token(page_token)
        rows, total = self.catalog.page(owner or None, include_public, after, limit + 1, kept)
        more = len(rows) > limit
        rows = rows[:limit]
        next_token = encode_page_token(rows[-1][0]) if more else ""
        return [record for _, record in rows], next_token, total

    def delete(self, key: AdapterKey) -> AdapterRecord:
        """Remove from the catalog (invisible at once to this replica, to the others once their
        watch delivers it); the blob goes when the collector finds it unreferenced."""
        record = self.resolve(key)
        if self.catalog.delete(record) and not self._pinned_elsewhere(record):
            self.ram.unpin(record.sha256)
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
                found = self.catalog.set_pinned(record, False)
                if not self._pinned_elsewhere(record):
                    self.ram.unpin(record.sha256)
            else:
                pinned_bytes = self._pinned_bytes_with(record)
                if pinned_bytes > self.ram.budget_bytes:
                    raise ResourceExhausted(
                        f"pinning adapter {record.name!r} of owner {record.owner!r} ({record.size_bytes} "
                        f"bytes) would pin {pinned_bytes} bytes, over the store's RAM budget of "
                        f"{self.ram.budget_bytes} bytes (--ram-budget-mib): unpin another adapter first"
                    )
                self.ram.pin(record.sha256)
                found = False
                try:
                    self.read_weights(record)  # hot from now on
                    found = self.catalog.set_pinned(record, True)
                finally:
                    if not found and not self._pinned_elsewhere(record):  # nothing pinned
                        self.ram.unpin(record.sha256)
            if not found:
                raise NotFound(f"adapter id {record.id!r} was deleted")
            return replace(record, pinned=pinned)

    def _pinned_bytes_with(self, record: AdapterRecord) -> int:
        """Bytes the RAM tier would hold pinned with ``record`` pinned too: adapters with the same
        weights share one entry."""
        pinned = {r.sha256: r.size_bytes for r in self.catalog.all() if r.pinned}
        return sum((pinned | {record.sha256: record.size_bytes}).values())

    def pinned_ids(self) -> list[str]:
        """The ids of every pinned adapter."""
        return list(self.catalog.pinned_sizes())

    def read_weights(self, record: AdapterRecord) -> memoryview:
        """The safetensors bytes (read-only): from RAM if hot, else from the blob tier, verified
        against the catalog's sha256 before they are cached or served. A blob that fails is
        quarantined (the row removed, as :meth:`open` does with ``verify_on_open="sha256"``):
        DataLoss."""
        data = self.ram.get(record.sha256)
        if data is not None:
            return data
        try:
            data = self.blobs.get(record.sha256)
        except BlobMissing:
            if self.catalog.get(record.id) is None:
                raise NotFound(f"adapter id {record.id!r} was deleted") from None
            raise DataLoss(f"adapter {record.id!r}: weights blob {record.sha256} missing") from None
        if sha256_hex(data) != record.sha256:
            log.error(
                "adapter %s (%s/%s) blob sha256 mismatch: quarantined", record.id, record.owner, record.name
            )
            self._quarantine(record, corrupt_blob=True)
            raise DataLoss(f"adapter {record.id!r}: its weights blob fails its sha256 check; quarantined")
        self.ram.put(record.sha256, data)
        return data

    def weights_file(self, record: AdapterRecord) -> Path | None:
        """The weights' blob as a file that a process sharing this machine's file system can read
        (and check against ``record.sha256``); None where the blob tier keeps no such file."""
        return self.blobs.file_path(record.sha256)

    def stats(self) -> RepositoryStats:
        records = self.catalog.all()
        return RepositoryStats(
            adapters=len(records),
            disk_bytes=sum({r.sha256: r.size_bytes for r in records}.values()),
            ram_bytes=self.ram.bytes_used,
            ram_budget_bytes=self.ram.budget_bytes,
            ram_adapters=len(self.ram),
            ram_hits=self.ram.hits,
            ram_misses=self.ram.misses,
        )
