"""The adapter repository's registration path: validate, publish the blobs, commit the row.

Registration order is what makes it crash-safe: validate everything in memory (while the weights
are written to a staging file and flushed, :meth:`BlobBackend.stage`), read what the commit will
be checked against (:meth:`Catalog.prepare`), make the blobs durable, then commit the catalog row
in one etcd transaction. A registration is acknowledged only once both are done. A crash before
the commit leaves at most an orphan blob, which the collector removes later
(:mod:`services.adapter_store.blob_collector`); a reader never sees an adapter whose bytes are
not all stored. A registration is announced to the catalog's group commit from its start to its
commit (:meth:`Catalog.expect_commit`): a commit starting meanwhile waits briefly for it and takes
it in its transaction, instead of it starting the next one.

A tenant's storage quota (:mod:`services.adapter_store.tenant_storage_quota`) is checked before
the weights are staged, on a fresh read of its usage and the bytes it surely adds, then exactly
before the blobs are published, against the usage the commit requires unchanged. A registration
refused after publishing (its tenant's last room taken meanwhile by another replica, or its name)
takes back the blobs it wrote, so a refusal leaves nothing behind.

A publish under a name already registered keeps the last versions of the name
(:mod:`services.adapter_store.version_retention`); content one of them holds is published again
without being validated again (a rollback: its tensors were validated when first stored).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType

from services.adapter_store.adapter_record import PRIVATE, PUBLIC, AdapterRecord, DuplicateName
from services.adapter_store.blobs.backend import BlobBackend, StagedBlob
from services.adapter_store.catalog import Catalog, CatalogConflict, PreparedRegistration
from services.adapter_store.catalog_keys import record_digests, record_texts
from services.adapter_store.chat_templates import AdapterChatTemplates, read_chat_templates
from services.adapter_store.group_commit import Expected
from services.adapter_store.ram_tier import RamTier
from services.adapter_store.storage_usage import StorageUsage, stored_bytes
from services.adapter_store.tenant_storage_quota import TenantStorageQuota
from services.adapter_store.validation import ValidatedAdapter, ValidationLimits, validate_adapter
from services.adapter_store.version_retention import VersionRetention, kept_content
from services.model_files.base_model import BaseModelSpec
from services.runtime.errors import AlreadyExists, InvalidArgument, ResourceExhausted, Unavailable
from services.runtime.tenants_file import QuotaConfig

log = logging.getLogger("loramesh.adapter_store")

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

    @cached_property
    def sha256(self) -> str:
        """Hex digest of the weights, computed once: a registration needs it several times, and
        a 10 MB adapter's takes about 12 ms."""
        return sha256_hex(self.weights)


def check_name(field: str, value: str) -> None:
    if not _NAME_RE.fullmatch(value or ""):
        raise InvalidArgument(
            f"{field} {value!r} is invalid: 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )


def sha256_hex(data) -> str:
    return hashlib.sha256(data).hexdigest()


MAX_COMMIT_ATTEMPTS = 50
"""Commits a registration tries while what it was prepared against keeps changing (another
replica registering the same name, a collector marking one of its blobs)."""
COLLECTOR_STALL_MS = 60_000
"""A collector's mark older than this is taken as abandoned (its replica died mid-collection)."""


@dataclass
class _Publication:
    """The blobs one registration must make durable, staged weights first."""

    staged: StagedBlob | None
    weights: object
    texts: dict[str, bytes]
    written: set[str] = field(default_factory=set)
    """Digests of the blobs it wrote (that were not there): what it takes back when refused."""


class AdapterRegistrar:
    """Registers adapters into the catalog, the blob tier and the RAM tier.

    ``quota``: the tenants' storage limits (none by default); ``withdraw(digest)`` removes a blob
    a refused registration published, unless a row references it
    (:meth:`.blob_collector.BlobCollector.remove`). ``sleep`` waits between commit attempts while
    a collector holds a blob, ``clock`` (Unix seconds) ages the collectors' marks: both injected
    by tests. ``retention``: which versions of a name are kept after a newer one (none without
    it: a new version removes the one it replaces)."""

    def __init__(
        self,
        spec: BaseModelSpec,
        limits: ValidationLimits,
        blobs: BlobBackend,
        catalog: Catalog,
        ram: RamTier,
        *,
        quota: TenantStorageQuota | None = None,
        withdraw: Callable[[str], object] = lambda digest: None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
        retention: VersionRetention | None = None,
    ):
        self.spec = spec
        self.limits = limits
        self.blobs = blobs
        self.catalog = catalog
        self.ram = ram
        self.quota = quota or TenantStorageQuota(QuotaConfig(), catalog.usage, None)
        self._withdraw = withdraw
        self._sleep = sleep
        self._clock = clock
        self.retention = retention

    def register(self, upload: AdapterUpload) -> AdapterRecord:
        """Validate, store durably and commit one adapter under a new name. Nothing is kept if
        any step fails."""
        check_name("name", upload.name)
        check_name("owner", upload.owner)
        if self.catalog.mirror.get_by_name(upload.owner, upload.name) is not None:
            raise _already_exists(upload)  # early, from this replica's copy; the commit decides
        with self.catalog.expect_commit() as expected:
            usage = self._check_quota(upload, None)
            staged = self.blobs.stage(upload.weights)
            try:
                validated = self._validate(upload)
            except BaseException:
                staged.discard()
                raise
            record = self._record(upload, validated, version=0)
            publication = _Publication(staged, upload.weights, {})
            return self._commit(upload, record, publication, None, usage, expected)

    def register_version(self, upload: AdapterUpload) -> AdapterRegistration:
        """As :meth:`register`, but a name already registered is not refused: the same content
        is kept as it is, other content replaces it as the next version (a new id, so no cache
        keyed by id serves the old weights under it). What an import does, and a publish.

        Content a kept version of the name holds (weights and config) is a rollback: committed
        as the next version with that version's validated fields, nothing validated again."""
        check_name("name", upload.name)
        check_name("owner", upload.owner)
        with self.catalog.expect_commit() as expected:
            return self._register_version(upload, expected)

    def _register_version(self, upload: AdapterUpload, expected: Expected) -> AdapterRegistration:
        current = self.catalog.get_by_name(upload.owner, upload.name)
        usage = self._check_quota(upload, current)
        rollback = self._rollback(upload, current)
        if rollback is not None:
            publication = _Publication(None, upload.weights, {})
            record = self._commit(upload, rollback, publication, current, usage, expected)
            return self._registration(rollback, record)
        # A name already registered is most often imported again unchanged: its weights are
        # written only once they are known to differ.
        staged = self.blobs.stage(upload.weights) if current is None else None
        try:
            validated = self._validate(upload)
        except BaseException:
            if staged is not None:
                staged.discard()
            raise
        if current is not None:
            unchanged = self._record(upload, validated, version=current.version)
            if _content(current) == _content(unchanged):
                self._heal(current, upload.weights)
                return AdapterRegistration(current, changed=False)
        record = self._record(upload, validated, version=0)
        publication = _Publication(staged, upload.weights, {})
        committed = self._commit(upload, record, publication, current, usage, expected)
        return self._registration(record, committed)

    def _registration(self, record: AdapterRecord, committed: AdapterRecord) -> AdapterRegistration:
        """What a publish of ``record`` did, ``committed`` being what its commit returned: the
        record itself (a new version, its name's versions past the retention pruned), or the
        version that serves this very content already, committed meanwhile (unchanged)."""
        if committed.id != record.id:
            return AdapterRegistration(committed, changed=False)
        return AdapterRegistration(self._pruned(committed), changed=True)

    def _rollback(self, upload: AdapterUpload, current: AdapterRecord | None) -> AdapterRecord | None:
        """The record a publish of a kept version's content commits (fields of that version, a
        new id), None when the content is new or the name serves it now."""
        if current is None or self.retention is None:
            return None
        sha256 = upload.sha256
        if sha256 == current.sha256:
            return None  # unchanged, or its config or templates changed: the usual path
        config = upload.config_bytes.decode("utf-8", errors="replace")
        kept = kept_content(self.retention.versions(upload.owner, upload.name), sha256, config)
        if kept is None:
            return None
        templates = read_chat_templates(upload.tokenizer_files)
        return replace(
            kept,
            id=uuid.uuid4().hex,
            visibility=upload.visibility if upload.visibility in (PRIVATE, PUBLIC) else PRIVATE,
            version=0,
            created_ms=int(time.time() * 1000),
            chat_template=templates.chat_template,
            tool_use_chat_template=templates.tool_use_chat_template,
            pinned=False,
        )

    def _pruned(self, record: AdapterRecord) -> AdapterRecord:
        """``record``, a new version just committed, after its name's versions past the
        retention were pruned."""
        if self.retention is not None:
            self.retention.prune(record.owner, record.name, record.version)
        return record

    def _check_quota(self, upload: AdapterUpload, replacing: AdapterRecord | None) -> StorageUsage | None:
        """Before anything is staged: the owner's usage read now (None without a storage quota),
        refused when even the weights and config alone (bytes it surely stores) would not fit."""
        usage = self.quota.usage_for(upload.owner)
        least = len(upload.weights) + len(upload.config_bytes)
        replaced = stored_bytes(replacing) if replacing is not None else 0
        self.quota.check(upload.owner, usage, int(replacing is None), least - replaced, _what(upload, least))
        return usage

    def _validate(self, upload: AdapterUpload) -> tuple[ValidatedAdapter, AdapterChatTemplates]:
        validated = validate_adapter(upload.config_bytes, upload.weights, self.spec, self.limits)
        return validated, read_chat_templates(upload.tokenizer_files)

    def _record(
        self, upload: AdapterUpload, validated: tuple[ValidatedAdapter, AdapterChatTemplates], version: int
    ) -> AdapterRecord:
        adapter, templates = validated
        return AdapterRecord(
            id=uuid.uuid4().hex,
            name=upload.name,
            owner=upload.owner,
            visibility=upload.visibility if upload.visibility in (PRIVATE, PUBLIC) else PRIVATE,
            base_model=self.spec.name,
            pet_type="lora",
            rank=adapter.config.rank,
            max_rank=adapter.max_rank,
            lora_alpha=adapter.config.alpha,
            use_rslora=adapter.config.use_rslora,
            target_modules=tuple(adapter.target_modules),
            dtype=adapter.dtype,
            size_bytes=len(upload.weights),
            sha256=upload.sha256,
            version=version,
            created_ms=int(time.time() * 1000),
            config_json=upload.config_bytes.decode("utf-8"),
            chat_template=templates.chat_template,
            tool_use_chat_template=templates.tool_use_chat_template,
        )

    def _commit(
        self,
        upload: AdapterUpload,
        record: AdapterRecord,
        publication: _Publication,
        replacing: AdapterRecord | None,
        usage: StorageUsage | None,
        expected: Expected,
    ) -> AdapterRecord:
        """Prepare, check the owner's quota, publish the blobs, commit; again while what it was
        prepared against changes. ``record``: what to commit (its version is given here);
        ``usage``: the owner's, read before staging (None: no quota); ``expected``: the
        registration's announcement to the group commit. Returns what was committed,
        or the version another registration committed meanwhile with ``record``'s very content
        (:func:`_content`), which is kept instead.

        The blobs are published after their collector marks were read (:meth:`Catalog.prepare`,
        or the state a failed commit returns; a first try of a new name assumes them never set,
        :meth:`PreparedRegistration.assumed_new`) and the commit requires the marks unchanged, so
        no collector deletes a blob between its publication here and the commit
        (:mod:`services.adapter_store.blob_collector`). A blob already present is not written
        again.

        Only a pinned adapter and a name's new version go into the RAM tier here: every worker
        serving the name pulls a new version at once (a training loop's publishes), which would
        otherwise read the blob back and hash it again; a new name enters it when first fetched,
        so registering thousands does not evict the adapters in use."""
        publication.texts = record_texts(record)
        digests = set(record_digests(record).values())
        owner, with_usage = upload.owner, usage is not None
        retire = self.retention is not None and self.retention.retires

        def prepare() -> PreparedRegistration:
            return self.catalog.prepare(owner, upload.name, digests, with_usage)

        prepared = PreparedRegistration.assumed_new(digests, usage) if replacing is None else prepare()
        try:
            for _ in range(MAX_COMMIT_ATTEMPTS):
                if prepared.serving_id != (replacing.id if replacing else ""):
                    if replacing is None or not prepared.serving_id:
                        raise _already_exists(upload)
                    replacing = self.catalog.get(prepared.serving_id)  # another version won: replace it
                    if replacing is None:
                        prepared = prepare()
                        continue
                    if _content(replacing) == _content(record):
                        return replacing  # committed meanwhile (_same_content_serving)
                if self._wait_for_collectors(prepared):
                    prepared = prepare()
                    continue
                record = replace(
                    record,
                    version=prepared.last_version + 1,
                    pinned=replacing.pinned if replacing else False,  # a pin is the name's
                )
                added = stored_bytes(record) - (stored_bytes(replacing) if replacing else 0)
                self.quota.check(
                    owner, prepared.usage, int(replacing is None), added, _what(upload, stored_bytes(record))
                )
                self._publish(record, publication)
                try:
                    limits = self.quota.limits(owner)
                    self.catalog.commit(record, prepared, replacing, limits, retire, expected)
                except CatalogConflict as conflict:
                    prepared = conflict.fresh
                    continue
                except DuplicateName as duplicate:
                    serving = self._same_content_serving(duplicate.serving_id, record, replacing)
                    if serving is None:
                        raise _already_exists(upload) from None
                    return serving
                break
            else:
                raise Unavailable(
                    f"adapter {upload.name!r} of owner {upload.owner!r}: the catalog changed under "
                    f"{MAX_COMMIT_ATTEMPTS} commits in a row; try again"
                )
        except (AlreadyExists, ResourceExhausted):
            self._take_back(publication.written)
            raise
        finally:
            if publication.staged is not None:
                publication.staged.discard()
        if record.pinned:
            self.ram.pin(record.sha256)
        if record.pinned or replacing is not None:
            self.ram.put(record.sha256, upload.weights)
        return record

    def _same_content_serving(
        self, serving_id: str, record: AdapterRecord, replacing: AdapterRecord | None
    ) -> AdapterRecord | None:
        """For a new version (``replacing`` given) that lost its name to ``serving_id``: that
        version when it holds ``record``'s very content, else None. Most often this publish
        (or import) itself, retried on another replica while this one was slow or stopped: kept
        as it is, as when the name serves the content already, not refused nor committed again
        as a copy, so a retried publish is acknowledged once, as one version."""
        if replacing is None or not serving_id:
            return None
        serving = self.catalog.get(serving_id)
        return serving if serving is not None and _content(serving) == _content(record) else None

    def _wait_for_collectors(self, prepared: PreparedRegistration) -> bool:
        """True (after a short wait) when a collector is deleting one of the blobs now."""
        if prepared.collecting(int(self._clock() * 1000), COLLECTOR_STALL_MS):
            self._sleep(0.05)
            return True
        return False

    def _publish(self, record: AdapterRecord, publication: _Publication) -> None:
        """Publish every blob of ``record`` (durable once the catalog's commit has flushed the
        blob tier, before the row commits); the staged weights are used once."""
        staged, publication.staged = publication.staged, None
        if staged is not None and not self.blobs.exists(record.sha256):
            staged.publish(record.sha256)
            publication.written.add(record.sha256)
        else:
            if staged is not None:
                staged.discard()
            if not self.blobs.exists(record.sha256):
                self.blobs.put(record.sha256, publication.weights)
                publication.written.add(record.sha256)
        for digest, data in publication.texts.items():
            if not self.blobs.exists(digest):
                self.blobs.put(digest, data)
                publication.written.add(digest)

    def _take_back(self, digests: set[str]) -> None:
        """Remove the blobs a refused registration wrote, unless another row references them
        now; one that cannot be removed now (etcd away) is left to the collector."""
        for digest in digests:
            try:
                self._withdraw(digest)
            except Exception as error:  # noqa: BLE001 - the refusal stands; the collector removes it
                log.warning("blob %s of a refused registration is left to the collector: %s", digest, error)

    def _heal(self, record: AdapterRecord, weights) -> None:
        """Write back a blob of a registered adapter found missing (a referenced blob is never
        collected, so this only repairs a blob lost outside the store)."""
        if not self.blobs.exists(record.sha256):
            self.blobs.put(record.sha256, weights)
            self.blobs.flush()


def _what(upload: AdapterUpload, size: int) -> str:
    """How a quota refusal names the adapter it refuses."""
    return f"adapter {upload.name!r} ({size} bytes)"


def _already_exists(upload: AdapterUpload) -> AlreadyExists:
    return AlreadyExists(f"adapter {upload.name!r} already exists for owner {upload.owner!r}")


def _content(record: AdapterRecord) -> tuple:
    """What a registration serves: weights, config, chat templates, visibility."""
    return (
        record.sha256,
        record.config_json,
        record.chat_template,
        record.tool_use_chat_template,
        record.visibility,
    )
