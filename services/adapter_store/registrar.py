"""The adapter repository's registration path: validate, write the blob durably, commit the row.

Registration order is what makes it crash-safe: validate everything in memory (while the weights
are written to a temp file and flushed, :mod:`services.adapter_store.blob_writes`), make the blob
durable (rename, directory fsync), then commit the catalog row; the directory fsync and the
commit are shared by the registrations that finish together (group commit), and a registration is
acknowledged only once both are done. A crash before the commit leaves an orphan blob that
:meth:`AdapterRepository.open` removes; a reader never sees an adapter whose bytes are not all on
disk.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
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
from services.runtime.errors import AlreadyExists, InvalidArgument

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class AdapterRegistration:
    """What registering content under a name did."""

    record: AdapterRecord
    """The adapter the name now serves."""
    changed: bool
    """False: the name already held this very content (weights, config, templates, visibility),
    which was kept as it was, same id and version."""


@dataclass(frozen=True)
class AdapterUpload:
    """An adapter's files and the name it is registered under: what a registration takes."""

    name: str
    """The adapter's name, unique within its owner's."""
    owner: str
    """The tenant it belongs to."""
    visibility: int
    """``PRIVATE`` or ``PUBLIC``; any other value registers it private."""
    config_bytes: bytes
    """``adapter_config.json``."""
    weights: bytes
    """``adapter_model.safetensors``."""
    tokenizer_files: Mapping[str, bytes] = field(default_factory=lambda: MappingProxyType({}))
    """The uploaded tokenizer files by name, whose chat template the adapter is served with
    (:mod:`services.adapter_store.chat_templates`)."""


def check_name(field: str, value: str) -> None:
    if not _NAME_RE.fullmatch(value or ""):
        raise InvalidArgument(
            f"{field} {value!r} is invalid: 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )


class AdapterRegistrar:
    """Registers adapters into the repository's catalog, blobs and RAM tier.

    ``change_lock`` is the repository's: held from a catalog change's commit to its publication
    on ``changes``, so changes publish in commit order. ``count_disk_bytes`` adds to (or, given a
    negative number, takes from) the repository's count of bytes on disk."""

    def __init__(
        self,
        spec: BaseModelSpec,
        limits: ValidationLimits,
        blobs: BlobStore,
        catalog: Catalog,
        ram: RamTier,
        changes: CatalogChanges,
        change_lock: threading.Lock,
        count_disk_bytes: Callable[[int], None],
    ):
        self.spec = spec
        self.limits = limits
        self.blobs = blobs
        self.catalog = catalog
        self.ram = ram
        self._changes = changes
        self._change_lock = change_lock
        self._count_disk_bytes = count_disk_bytes
        self._commits: GroupCommit[tuple[AdapterRecord, str]] = GroupCommit(self._commit_batch)
        self._blob_writes = BlobWrites(self.blobs)

    def close(self) -> None:
        self._blob_writes.close()

    def register(self, upload: AdapterUpload) -> AdapterRecord:
        """Validate, store durably and commit one adapter. Nothing is kept if any step fails."""
        name, owner = upload.name, upload.owner
        check_name("name", name)
        check_name("owner", owner)
        if self.catalog.get_by_name(owner, name) is not None:
            raise AlreadyExists(f"adapter {name!r} already exists for owner {owner!r}")
        written = self._blob_writes.start(upload.weights)
        record = self._validated_record(written, upload)
        self._commit(record, upload.weights, written)
        return record

    def register_version(self, upload: AdapterUpload) -> AdapterRegistration:
        """As :meth:`register`, but a name already registered is not refused: the same content
        is kept as it is, other content replaces it as the next version (a new id, so no cache
        keyed by id serves the old weights under it). What an import does."""
        check_name("name", upload.name)
        check_name("owner", upload.owner)
        current = self.catalog.get_by_name(upload.owner, upload.name)
        weights = upload.weights
        # A name already registered is most often imported again unchanged: its weights are
        # written only once they are known to differ.
        written = self._blob_writes.start(weights) if current is None else None
        record = self._validated_record(written, upload)
        if current is not None and _content(current) == _content(record):
            return AdapterRegistration(current, changed=False)
        if current is not None:
            record = replace(record, pinned=current.pinned)  # a pin is the name's, not a version's
        self._commit(record, weights, written or self._blob_writes.start(weights), replacing=current)
        return AdapterRegistration(record, changed=True)

    def _validated_record(self, written: PendingBlob | None, upload: AdapterUpload) -> AdapterRecord:
        """The record of a valid adapter. When anything fails, ``written`` (the write of its
        weights, if started) is discarded before the error goes on."""
        name, owner, weights, config_bytes = upload.name, upload.owner, upload.weights, upload.config_bytes
        visibility = upload.visibility if upload.visibility in (PRIVATE, PUBLIC) else PRIVATE
        try:
            validated = validate_adapter(config_bytes, weights, self.spec, self.limits)
            templates = read_chat_templates(upload.tokenizer_files)
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
        self._count_disk_bytes(record.size_bytes)
        if record.pinned:
            self.ram.pin(record.id)
            self.ram.put(record.id, weights)
        if replacing is not None:
            self.blobs.delete(replacing.id)
            self.ram.discard(replacing.id)
            self.ram.unpin(replacing.id)
            self._count_disk_bytes(-replacing.size_bytes)

    def _commit_batch(self, entries: Sequence[tuple[AdapterRecord, str]]) -> list[DuplicateName | None]:
        """One group of registrations: their blobs' renames made durable, then their rows
        committed in one transaction and published."""
        self.blobs.sync_dir()
        with self._change_lock:
            results = self.catalog.insert_many(entries)
            for (record, replacing), result in zip(entries, results, strict=True):
                if result is None:
                    if replacing:
                        self._changes.publish(CatalogChange(deleted_id=replacing))
                    self._changes.publish(CatalogChange(upserted=record))
        return results


def _content(record: AdapterRecord) -> tuple:
    """What a registration serves: weights, config, chat templates, visibility."""
    return (
        record.sha256,
        record.config_json,
        record.chat_template,
        record.tool_use_chat_template,
        record.visibility,
    )
