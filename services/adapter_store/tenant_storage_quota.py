"""The adapter store's side of the tenants' limits: what a tenant stores, and its uploads in flight.

Three limits of the tenants file (``--tenants-file``, :mod:`services.runtime.tenants_file`), each
off (0) by default, hold across every replica together:

- ``max_adapters`` and ``max_stored_bytes``: the tenant's adapters and their bytes (weights,
  config and chat templates; :func:`.storage_usage.stored_bytes`). Checked as early as each is
  known, and exactly at the commit: at an upload's header (refused when the tenant has no room
  at all), while its files arrive (refused once the weights and config received pass the bytes
  left), before the weights are staged (a fresh read of the tenant's usage), and before the
  blobs are published and the row committed, against the usage the commit requires unchanged
  (:mod:`.storage_usage`). A refusal there leaves nothing: no row, no usage, and no blob it
  wrote (:meth:`.registrar.AdapterRegistrar` withdraws them when a race is lost after they were
  published). A new version replacing another counts the difference of their bytes and no new
  adapter; a limit lowered below what a tenant stores refuses its additions, never what frees room.
- ``max_concurrent_uploads``: uploads and imports in flight (:mod:`.upload_slots`), refused with
  a retry hint.

Refusals are :class:`~services.runtime.errors.ResourceExhausted` naming the tenant, the limit and
the numbers: gRPC ``RESOURCE_EXHAUSTED``, relayed by the gateway, HTTP 429 on its routes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.adapter_store.storage_usage import StorageUsage
from services.adapter_store.upload_slots import FREE_SLOT, UploadSlot, UploadSlots
from services.runtime.errors import ResourceExhausted
from services.runtime.tenants_file import QuotaConfig, TenantLimits


def fits(limits: TenantLimits, usage: StorageUsage, adapters: int, added_bytes: int) -> bool:
    """Whether ``usage`` with ``adapters`` and ``added_bytes`` more stays within ``limits``
    (an addition of none, or of fewer bytes, always does)."""
    return not _over_count(limits, usage, adapters) and not _over_bytes(limits, usage, added_bytes)


def _over_count(limits: TenantLimits, usage: StorageUsage, adapters: int) -> bool:
    return bool(limits.max_adapters) and adapters > 0 and usage.adapters + adapters > limits.max_adapters


def _over_bytes(limits: TenantLimits, usage: StorageUsage, added_bytes: int) -> bool:
    return (
        bool(limits.max_stored_bytes)
        and added_bytes > 0
        and usage.bytes + added_bytes > limits.max_stored_bytes
    )


def check_storage(
    owner: str, limits: TenantLimits, usage: StorageUsage, adapters: int, added_bytes: int, what: str
) -> None:
    """ResourceExhausted, naming ``what`` is added and the limit it passes, unless ``usage``
    with ``adapters`` and ``added_bytes`` more fits ``limits``. No retry hint: only a deletion
    makes room."""
    if _over_count(limits, usage, adapters):
        raise ResourceExhausted(
            f"tenant {owner!r} stores {usage.adapters} adapter{'' if usage.adapters == 1 else 's'}, its limit (max_adapters "
            f"{limits.max_adapters}): delete one before adding {what}"
        )
    if _over_bytes(limits, usage, added_bytes):
        raise ResourceExhausted(
            f"{what} would take tenant {owner!r} to {usage.bytes + added_bytes} stored bytes, past "
            f"its limit (max_stored_bytes {limits.max_stored_bytes}; {usage.bytes} stored now)"
        )


@dataclass
class UploadAdmission:
    """An upload or import let in: its slot, and the bytes its tenant has room for."""

    owner: str
    limits: TenantLimits
    usage: StorageUsage | None
    """The tenant's usage when it was let in (None: it has no byte limit)."""
    slot: UploadSlot = FREE_SLOT

    def check_received(self, kept_bytes: int) -> None:
        """ResourceExhausted once the weights and config received (``kept_bytes``, all of which
        the adapter would store) pass the room left: the rest need not be held."""
        if self.usage is not None and _over_bytes(self.limits, self.usage, kept_bytes):
            check_storage(
                self.owner, self.limits, self.usage, 0, kept_bytes, f"an upload of over {kept_bytes} bytes"
            )

    def release(self) -> None:
        self.slot.release()


class TenantStorageQuota:
    """Applies the tenants' storage and upload limits; ``read_usage(owner)`` reads a tenant's
    usage from etcd (:meth:`.catalog.Catalog.usage`)."""

    def __init__(
        self, quotas: QuotaConfig, read_usage: Callable[[str], StorageUsage], slots: UploadSlots | None
    ):
        """``slots`` None: uploads in flight are not bounded (a repository opened without a
        tenants file, as the tests' are)."""
        self.quotas = quotas
        self._read_usage = read_usage
        self._slots = slots

    def limits(self, owner: str) -> TenantLimits:
        return self.quotas.for_tenant(owner)

    def admit(self, owner: str, new_adapter: bool) -> UploadAdmission:
        """At an upload's or import's start: refused at once when the tenant cannot add
        ``new_adapter`` (an upload always adds one; an import may replace a version) or has no
        byte left, else let in holding one of its upload slots (ResourceExhausted with a retry
        hint when they are all held). Release the admission when it ends."""
        limits = self.limits(owner)
        usage = None
        if new_adapter and limits.limits_storage:
            usage = self._read_usage(owner)
            check_storage(owner, limits, usage, 1, 1, "another adapter")
        admission = UploadAdmission(owner, limits, usage if limits.max_stored_bytes else None)
        if limits.max_concurrent_uploads and self._slots is not None:
            admission.slot = self._slots.acquire(owner, limits.max_concurrent_uploads)
        return admission

    def admits_without_etcd(self, owner: str) -> bool:
        """Whether :meth:`admit` of ``owner``, and releasing what it lets in, touch no etcd key
        (no storage limit, no upload slots): an event loop may call them itself instead of on a
        thread, which is two thread hops per upload saved."""
        limits = self.limits(owner)
        return not limits.limits_storage and not (limits.max_concurrent_uploads and self._slots is not None)

    def usage_for(self, owner: str) -> StorageUsage | None:
        """``owner``'s usage read now, for a registration to be checked and committed against;
        None when it has no storage limit (its registrations are not checked)."""
        return self._read_usage(owner) if self.limits(owner).limits_storage else None

    def check(
        self, owner: str, usage: StorageUsage | None, adapters: int, added_bytes: int, what: str
    ) -> None:
        """:func:`check_storage` against ``owner``'s limits (nothing when ``usage`` is None)."""
        if usage is not None:
            check_storage(owner, self.limits(owner), usage, adapters, added_bytes, what)
