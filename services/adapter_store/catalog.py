"""The adapter catalog in etcd: the single source of truth every store replica shares.

Writes are etcd transactions (:mod:`.catalog_keys` names the keys):

- a registration commits its row, its name, its version and its blob references at once, only if
  the name is free (or still serves the version it replaces), the name's version counter is as it
  was read, and no collector has touched the blobs it relies on since it read their marks. Two
  replicas registering one name at once therefore yield one adapter and one
  :class:`~.adapter_record.DuplicateName`;
- a collector marks a blob ``collecting`` only if nothing references it, so a blob a committed
  row names is never deleted (:mod:`.blob_collector`);
- every row's usage entry is written and removed with it, and a registration under a tenant's
  storage quota commits only if no entry of its owner was created since it read them
  (:mod:`.storage_usage`), so two replicas never both take a tenant's last slot.

Reads are served from a :class:`~.catalog_mirror.CatalogMirror` kept current by a watch; a
replica's own write returns once its mirror has seen it, so the writer reads it back at once, and
a lookup the mirror misses asks etcd before answering NOT_FOUND (another replica may have just
committed it). Cut off from etcd, a replica refuses writes (UNAVAILABLE, saying why) and goes on
serving reads of what it holds.

The repository is synchronous and runs in worker threads. Its calls go to etcd from the
calling thread and the watch runs on a thread of its own, all over a blocking gRPC channel
(:mod:`.blocking_etcd`: no event loop to hop through on the registration's path). Only
``etcd_call`` (the upload slots, version retention) goes through aetcd's asyncio client, on an
event loop the catalog starts on a thread of its own when first needed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import aetcd

from services.adapter_store import etcd_ops
from services.adapter_store.adapter_record import AdapterRecord, DuplicateName
from services.adapter_store.blocking_etcd import BlockingEtcd, Txn
from services.adapter_store.catalog_changes import CatalogChanges
from services.adapter_store.catalog_keys import (
    BlobMark,
    CatalogKeys,
    decode_row,
    encode_row,
    record_digests,
)
from services.adapter_store.catalog_mirror import MIRROR_WAIT_S, CatalogMirror, Seq
from services.adapter_store.group_commit import Expected, GroupCommit
from services.adapter_store.row_texts import RowTexts
from services.adapter_store.storage_usage import StorageUsage, stored_bytes
from services.adapter_store.tenant_storage_quota import fits
from services.adapter_store.version_retention import kept_removals, retirement_ops
from services.runtime.errors import Unavailable
from services.runtime.etcd.membership import (
    EtcdConnection,
    EtcdUnreachable,
    MembershipConfig,
    describe_etcd_error,
)
from services.runtime.etcd.prefix_follower import (
    prefix_end,
)
from services.runtime.tenants_file import UNLIMITED, TenantLimits

log = logging.getLogger("loramesh.adapter_store")

T = TypeVar("T")

_MAX_BACKOFF_S = 1.0
MAX_REGISTRATIONS_PER_TXN = 16
"""Registrations one transaction commits at most: each is about 6 writes and 5 checks, and etcd
takes at most 128 of either in a transaction (its ``--max-txn-ops``)."""


class CatalogConflict(Exception):
    """The keys a registration was prepared against changed before it committed; ``fresh``:
    what they hold now, to try again against."""

    def __init__(self, what: str, fresh: PreparedRegistration):
        super().__init__(what)
        self.fresh = fresh


@dataclass(frozen=True)
class BlobState:
    """One blob's collector mark as a registration read it."""

    mod_revision: int
    """0: no mark (never collected)."""
    mark: BlobMark | None


@dataclass(frozen=True)
class PreparedRegistration:
    """What a registration of ``(owner, name)`` read before it publishes its blobs and commits."""

    serving_id: str
    """Id of the adapter the name serves now; "" when it is free."""
    last_version: int
    """The name's version counter (0: never registered)."""
    version_mod_revision: int
    blobs: dict[str, BlobState]
    """By digest."""
    usage: StorageUsage | None = None
    """The owner's usage as read, which the commit requires unchanged (no entry created since);
    None: not read, not checked (an owner without a storage quota)."""

    @classmethod
    def assumed_new(cls, digests: set[str], usage: StorageUsage | None = None) -> PreparedRegistration:
        """What a name never registered, relying on blobs no collector ever marked, is committed
        against: a registration tries this first and reads only when its commit fails, so the
        common case costs one etcd transaction. Sound for the blobs too: a mark, once set, is
        never removed, so a mark still absent at the commit was never set."""
        return cls("", 0, 0, {digest: BlobState(0, None) for digest in digests}, usage)

    def collecting(self, now_ms: int, stall_ms: int) -> list[str]:
        """Digests a collector is deleting now (a mark older than ``stall_ms`` is abandoned)."""
        return [
            digest
            for digest, state in self.blobs.items()
            if state.mark is not None
            and state.mark.state == "collecting"
            and now_ms - state.mark.since_ms < stall_ms
        ]


@dataclass
class _Registration:
    """One registration's commit: its checks and its writes."""

    record: AdapterRecord
    prepared: PreparedRegistration
    replacing: AdapterRecord | None
    limits: TenantLimits = UNLIMITED
    """The owner's storage limits, which registrations of one owner committing together must fit
    in together."""
    committed: int = 0
    """The revision it was committed at, once it was."""
    retire: bool = False
    """Keep the version it replaces as a kept version (:mod:`.version_retention`)."""

    def compare(self, keys: CatalogKeys) -> list:
        record, prepared = self.record, self.prepared
        name_key = keys.name(record.owner, record.name).encode()
        compare = [
            etcd_ops.value_is(name_key, self.replacing.id.encode())
            if self.replacing
            else etcd_ops.absent(name_key),
            etcd_ops.mod_is(keys.version(record.owner, record.name).encode(), prepared.version_mod_revision),
            *(
                etcd_ops.mod_is(keys.blob_mark(d).encode(), state.mod_revision)
                for d, state in prepared.blobs.items()
            ),
        ]
        if prepared.usage is not None:
            usage = keys.usage(record.owner)
            compare.append(
                etcd_ops.none_created_since(usage.encode(), prefix_end(usage), prepared.usage.newest)
            )
        return compare

    def ops(self, keys: CatalogKeys) -> list:
        record = self.record
        # The version replaced goes first: a watcher sees its removal, then the new row (a
        # retired one stays, as a kept version).
        ops = []
        if self.replacing is not None and self.retire:
            ops = retirement_ops(keys, self.replacing)
        elif self.replacing is not None:
            ops = row_removal(keys, self.replacing, with_name=False)
        return ops + [
            etcd_ops.put(keys.row(record.id).encode(), encode_row(record)),
            etcd_ops.put(keys.name(record.owner, record.name).encode(), record.id.encode()),
            etcd_ops.put(keys.version(record.owner, record.name).encode(), str(record.version).encode()),
            *(
                etcd_ops.put(keys.ref(d, record.id).encode(), b"")
                for d in set(record_digests(record).values())
            ),
            usage_put(keys, record),
        ]

    def delta(self) -> tuple[int, int]:
        """Adapters and bytes its commit adds to its owner's usage."""
        replaced = stored_bytes(self.replacing) if self.replacing is not None else 0
        return int(self.replacing is None), stored_bytes(self.record) - replaced


def usage_put(keys: CatalogKeys, record: AdapterRecord):
    """The write of ``record``'s usage entry."""
    entry = keys.usage_entry(record.owner, record.id).encode()
    return etcd_ops.put(entry, str(stored_bytes(record)).encode())


def row_removal(keys: CatalogKeys, record: AdapterRecord, with_name: bool) -> list:
    """The writes that take ``record`` out of the catalog (its name too, ``with_name``)."""
    ops = [
        etcd_ops.delete(keys.row(record.id).encode()),
        etcd_ops.delete(keys.usage_entry(record.owner, record.id).encode()),
    ]
    ops += [etcd_ops.delete(keys.ref(d, record.id).encode()) for d in set(record_digests(record).values())]
    if with_name:
        ops.append(etcd_ops.delete(keys.name(record.owner, record.name).encode()))
    return ops


class Catalog:
    """The etcd catalog with its in-memory mirror. ``read_text(sha256) -> str`` reads the text
    parts of rows (config, chat templates) from the blob tier; ``before_commit()`` (the blob
    tier's flush) runs for each group of registrations after they were all queued and before any
    of them commits, so their blobs are durable first (:class:`GroupCommit`: one group's flush
    overlaps the commit of the group before it)."""

    def __init__(
        self,
        config: MembershipConfig,
        read_text: Callable[[str], str],
        replica_id: str,
        before_commit: Callable[[], None] = lambda: None,
    ):
        self.config = config
        self.keys = CatalogKeys.under(config.key_prefix)
        self.replica_id = replica_id
        self.changes = CatalogChanges()
        """Every change of the catalog, this replica's and the others', in the order this
        replica's copy took them."""
        self.mirror = CatalogMirror(self.changes)
        self.problem = ""
        """Why the catalog cannot take writes now ("" while it can): for the health check."""
        self._read_text = RowTexts(read_text)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="etcd-catalog", daemon=True)
        self._conn = EtcdConnection(config)
        self._etcd = BlockingEtcd(config)
        self._loop_lock = threading.Lock()
        self._follower = threading.Thread(target=self._follow, name="catalog-watch", daemon=True)
        self._closing = threading.Event()
        self._commits: GroupCommit[_Registration] = GroupCommit(self._commit_group, before_commit)
        self._listed = threading.Event()

    # -- lifecycle --

    def open(self, timeout_s: float = 30.0) -> None:
        """List the catalog into the mirror and start watching it; Unavailable when etcd cannot
        be read within ``timeout_s``. Opening an open catalog does nothing."""
        if self._follower.is_alive():
            return
        self._follower.start()
        if not self._listed.wait(timeout_s):
            raise Unavailable(
                f"cannot list the adapter catalog from etcd within {timeout_s:g} s: {self.problem}"
            )

    def close(self) -> None:
        if not self._follower.is_alive():
            return
        self._closing.set()
        self._etcd.close()  # ends the watch
        self._follower.join()
        with self._loop_lock:
            if self._thread.is_alive():
                asyncio.run_coroutine_threadsafe(self._conn.close(), self._loop).result()
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
        self._loop.close()
        self._etcd.close()

    def _submit(self, coro: Awaitable[T]) -> Future[T]:
        """Run ``coro`` on the catalog's event loop, started at its first use: a loop that gRPC's
        asyncio client was used on is woken by every completion of the process's asyncio gRPC
        calls (the server's too: its poller wakes every loop bound to it), so a replica that
        needs no ``etcd_call`` runs none."""
        with self._loop_lock:
            if not self._thread.is_alive():
                self._thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]

    def _call(self, fn: Callable[[aetcd.Client], Awaitable[T]], what: str) -> T:
        """``fn(client)`` on the catalog's loop, bounded by the call timeout; Unavailable (naming
        ``what`` and the cause) when etcd does not answer."""

        async def call() -> T:
            try:
                return await self._conn.checked_call(fn, what)
            except EtcdUnreachable as error:
                self.problem = error.problem
                raise Unavailable(f"adapter catalog: {error}") from None

        return self._submit(call()).result()

    def _txn(self, compare: Sequence[Any], success: Sequence[Any], failure: Sequence[Any], what: str):
        """One transaction from this thread (:mod:`.blocking_etcd`): ``(succeeded, responses)`` as
        aetcd's ``transaction`` gives them; Unavailable (naming ``what`` and the cause) when etcd
        does not answer."""
        try:
            return self._etcd.one(compare, success, failure, what)
        except EtcdUnreachable as error:
            self.problem = error.problem
            raise Unavailable(f"adapter catalog: {error}") from None

    def _get(self, key: bytes, what: str) -> Any:
        """The key-value at ``key`` (None when there is none); Unavailable (naming ``what`` and
        the cause) when etcd does not answer."""
        try:
            return self._etcd.get(key, what)
        except EtcdUnreachable as error:
            self.problem = error.problem
            raise Unavailable(f"adapter catalog: {error}") from None

    def etcd_call(self, fn: Callable[[aetcd.Client], Awaitable[T]], what: str) -> T:
        """``fn(client)`` on the catalog's connection (as every catalog call): Unavailable,
        naming ``what`` and the cause, when etcd does not answer."""
        return self._call(fn, what)

    # -- the watch --

    def _follow(self) -> None:
        """List, then watch from the next revision; on any failure list again (with backoff).
        Runs on a thread of its own (:mod:`.blocking_etcd`) until the catalog closes."""
        backoff = 0.1
        while not self._closing.is_set():
            try:
                revision = self._list_rows()
                self._listed.set()
                self.problem, backoff = "", 0.1
                start, end = self.keys.rows.encode(), prefix_end(self.keys.rows)
                for response in self._etcd.watch(start, end, revision + 1, "watch the adapter catalog"):
                    for event in response.events:
                        self._apply(event)
            except Exception as error:  # noqa: BLE001 - any failure: list again
                if self._closing.is_set():
                    return
                self.problem = (
                    error.problem
                    if isinstance(error, EtcdUnreachable)
                    else f"etcd at {self._etcd.endpoint} unreachable ({describe_etcd_error(error)})"
                )
                log.warning("adapter catalog watch failed: %s; listing again", self.problem)
                self._closing.wait(backoff)
                backoff = min(_MAX_BACKOFF_S, backoff * 2)

    def _list_rows(self) -> int:
        """Every row into the mirror, read at one revision; that revision."""
        revision, kvs = self._etcd.list_prefix(self.keys.rows, "list the adapter catalog")
        self.mirror.replace(
            [(kv.create_revision, decode_row(kv.value, self._read_text)) for kv in kvs], revision
        )
        return revision

    def _apply(self, event: Any) -> None:
        """One watch event (an etcd ``mvccpb.Event``)."""
        kv = event.kv
        if event.type == event.PUT:
            if kv.version == 1 and self.mirror.get(self.keys.row_id(kv.key)) is not None:
                # A row's first write, already held: this replica's own registration, applied
                # when it committed (CatalogMirror.apply_own). Nothing to decode.
                self.mirror.advance(kv.mod_revision)
                return
            self.mirror.upsert(kv.create_revision, decode_row(kv.value, self._read_text), kv.mod_revision)
        else:
            self.mirror.remove(self.keys.row_id(kv.key), kv.mod_revision)

    def _await_mirror(self, shows: Callable[[], bool], what: str) -> None:
        """Wait for this replica's mirror to show its own write (so the writer reads it back)."""
        if not self.mirror.wait_until(shows, MIRROR_WAIT_S):
            log.warning("the catalog mirror does not show %s after %g s", what, MIRROR_WAIT_S)

    # -- reads --

    def get(self, adapter_id: str) -> AdapterRecord | None:
        record = self.mirror.get(adapter_id)
        if record is None:
            record = self._read_through(adapter_id)
        return record

    def _read_through(self, adapter_id: str) -> AdapterRecord | None:
        """A row the mirror lacks, read from etcd: another replica may have just committed it.
        With etcd unreachable the mirror's answer stands."""
        try:
            found = self._get(self.keys.row(adapter_id).encode(), "read a row")
        except Unavailable:
            return None
        return decode_row(found.value, self._read_text) if found else None

    def get_by_name(self, owner: str, name: str) -> AdapterRecord | None:
        record = self.mirror.get_by_name(owner, name)
        if record is None:
            try:
                found = self._get(self.keys.name(owner, name).encode(), "read a name")
            except Unavailable:
                return None
            if found:
                record = self.get(found.value.decode())
        return record

    def page(
        self, owner: str | None, include_public: bool, after_seq: Seq, limit: int, kept: bool = False
    ) -> tuple[list[tuple[Seq, AdapterRecord]], int]:
        return self.mirror.page(owner, include_public, after_seq, limit, kept)

    def all(self) -> list[AdapterRecord]:
        return self.mirror.all()

    def count(self) -> int:
        return self.mirror.count()

    def pinned_sizes(self) -> dict[str, int]:
        return self.mirror.pinned_sizes()

    # -- registration --

    def prepare(
        self, owner: str, name: str, digests: set[str], with_usage: bool = False
    ) -> PreparedRegistration:
        """Read, in one revision, what a registration of ``(owner, name)`` relying on the blobs
        ``digests`` will be committed against (the owner's usage too, ``with_usage``)."""
        _, responses = self._txn(
            compare=[],
            success=self._state_reads(owner, name, digests, with_usage),
            failure=[],
            what="read a name",
        )
        return self._prepared(responses, digests, with_usage)

    def _state_reads(self, owner: str, name: str, digests: set[str], with_usage: bool) -> list:
        usage = self.keys.usage(owner)
        return [
            etcd_ops.get(self.keys.name(owner, name).encode()),
            etcd_ops.get(self.keys.version(owner, name).encode()),
            *(etcd_ops.get(self.keys.blob_mark(d).encode()) for d in sorted(digests)),
            *([etcd_ops.get(usage.encode(), prefix_end(usage))] if with_usage else []),
        ]

    @staticmethod
    def _prepared(responses: list, digests: set[str], with_usage: bool) -> PreparedRegistration:
        usage = None
        if with_usage:
            *responses, entries = responses
            usage = StorageUsage.of_entries((value, kv.create_revision) for value, kv in entries)
        named, version, *marks = (response[0][1] if response else None for response in responses)
        return PreparedRegistration(
            serving_id=named.value.decode() if named else "",
            last_version=int(version.value) if version else 0,
            version_mod_revision=version.mod_revision if version else 0,
            blobs={
                digest: BlobState(mark.mod_revision, BlobMark.decode(mark.value))
                if mark
                else BlobState(0, None)
                for digest, mark in zip(sorted(digests), marks, strict=True)
            },
            usage=usage,
        )

    def usage(self, owner: str) -> StorageUsage:
        """What ``owner`` stores now, read from etcd (every replica's registrations)."""
        entries = self._list(self.keys.usage(owner), f"read the usage of tenant {owner!r}")
        return StorageUsage.of_entries((kv.value, kv.create_revision) for kv in entries)

    def _list(self, prefix: str, what: str) -> list[Any]:
        """Every key under ``prefix`` (etcd key-values), read at one revision a page at a time."""
        try:
            return self._etcd.list_prefix(prefix, what)[1]
        except EtcdUnreachable as error:
            self.problem = error.problem
            raise Unavailable(f"adapter catalog: {error}") from None

    def reconcile_usage(self) -> int:
        """Give every row of the mirror that lacks one its usage entry, and remove the entries of
        rows no longer in the catalog (a catalog written before entries existed, or by a replica
        of that time); returns how many it wrote or removed. Each write checks the row in the same
        transaction, so replicas doing this at once, or registering and deleting meanwhile, never
        leave an entry without its row or a row without its entry."""
        t, root = aetcd.transactions, self.keys.all_usage
        entries = {
            (owner, adapter_id): kv.mod_revision
            for kv in self._list(root, "list the usage entries")
            for owner, _, adapter_id in [kv.key.decode()[len(root) :].partition("/")]
        }
        rows = {(record.owner, record.id): record for record in self.mirror.all()}
        changed = 0
        for owner, adapter_id in rows.keys() - entries.keys():
            entry, row = self.keys.usage_entry(owner, adapter_id).encode(), self.keys.row(adapter_id).encode()
            succeeded, _ = self._txn(
                compare=[t.Version(row) > 0, t.Version(entry) == 0],
                success=[usage_put(self.keys, rows[owner, adapter_id])],
                failure=[],
                what="write a usage entry",
            )
            changed += succeeded
        for (owner, adapter_id), mod_revision in entries.items():
            if (owner, adapter_id) in rows:
                continue
            entry, row = self.keys.usage_entry(owner, adapter_id).encode(), self.keys.row(adapter_id).encode()
            succeeded, _ = self._txn(
                compare=[t.Version(row) == 0, t.Mod(entry) == mod_revision],
                success=[t.Delete(entry)],
                failure=[],
                what="remove a usage entry",
            )
            changed += succeeded
        if changed:
            log.warning("adapter catalog: %d usage entries written or removed to match the rows", changed)
        return changed

    def expect_commit(self) -> Expected:
        """Announce a registration on its way to :meth:`commit`, so that the commits starting
        meanwhile wait for it (briefly) and take it in their group (:class:`GroupCommit`); a
        context that withdraws it if it never commits."""
        return self._commits.expect()

    def commit(
        self,
        record: AdapterRecord,
        prepared: PreparedRegistration,
        replacing: AdapterRecord | None,
        limits: TenantLimits = UNLIMITED,
        retire: bool = False,
        expected: Expected | None = None,
    ) -> None:
        """Commit ``record`` (in place of ``replacing``, the version the name served when
        prepared, or as a new name; ``retire``: ``replacing`` is kept as a kept version, not
        removed); :class:`DuplicateName` when the name serves another adapter,
        :class:`CatalogConflict` (with what the keys hold now) when anything else it was
        prepared against changed. ``expected``: the registration's announcement
        (:meth:`expect_commit`).

        Registrations committing at the same time share one transaction when they can (group
        commit: etcd's proposal and WAL flush are shared, each registration's checks are all in
        it, and the registrations of one owner under ``limits`` must fit in them together); when
        that transaction's checks fail, each is committed alone, so one registration's conflict
        never fails another's."""
        registration = _Registration(record, prepared, replacing, limits, retire=retire)
        self._commits.submit(registration, expected)
        replaced = replacing.id if replacing is not None and not retire else ""
        self.mirror.apply_own(registration.committed, record, replaced)

    def _commit_group(self, group: Sequence[_Registration]) -> list[Exception | None]:
        """One group of registrations (:class:`GroupCommit`): together when they may share a
        transaction and it succeeds, else one by one; an error or None each (their blobs were
        flushed)."""
        names = {(r.record.owner, r.record.name) for r in group}
        together = len(group) > 1 and len(names) == len(group) and all(r.replacing is None for r in group)
        size = MAX_REGISTRATIONS_PER_TXN if together else 1
        chunks = [group[start : start + size] for start in range(0, len(group), size)]
        if together and len(chunks) > 1 and all(r.prepared.usage is None for r in group):
            return self._commit_chunks_at_once(chunks)
        results: dict[int, Exception | None] = {}
        for chunk in chunks:
            results.update(self._rebase(chunk))
            pending = [r for r in chunk if id(r) not in results]
            if len(pending) > 1:
                succeeded, responses = self._txn(*self._chunk_txn(pending), what="commit registrations")
                if succeeded:
                    for registration in pending:
                        registration.committed = _revision(responses[0])
                        results[id(registration)] = None
                    continue
            results.update((id(r), self._commit_alone(r)) for r in pending)
        return [results[id(r)] for r in group]

    def _commit_chunks_at_once(self, chunks: Sequence[Sequence[_Registration]]) -> list[Exception | None]:
        """Registrations under no storage quota, of distinct new names, too many for one
        transaction: a transaction per chunk, all sent at once, so etcd commits them in one
        proposal and one WAL flush instead of one after another (none depends on another:
        their checks are on keys of their own). A chunk whose checks fail is committed one by
        one, as :meth:`_commit_group` does."""
        outcomes = self._etcd.at_once([self._chunk_txn(chunk) for chunk in chunks], "commit registrations")
        results: list[Exception | None] = []
        for chunk, outcome in zip(chunks, outcomes, strict=True):
            if isinstance(outcome, EtcdUnreachable):
                self.problem = outcome.problem
                results += [Unavailable(f"adapter catalog: {outcome}")] * len(chunk)
            elif outcome[0]:
                for registration in chunk:
                    registration.committed = _revision(outcome[1][0])
                results += [None] * len(chunk)
            else:
                results += [self._commit_alone(r) for r in chunk]
        return results

    def _chunk_txn(self, chunk: Sequence[_Registration]) -> Txn:
        """One chunk's registrations in one transaction."""
        return (
            [c for r in chunk for c in r.compare(self.keys)],
            [op for r in chunk for op in r.ops(self.keys)],
            [],
        )

    def _rebase(self, chunk: Sequence[_Registration]) -> dict[int, Exception]:
        """Check the registrations under a storage quota against their owners' usage read now
        (one read for the chunk), in order, each with the ones before it: those that fit are
        committed against that usage (no entry of the owner created since), the others get a
        :class:`CatalogConflict` with it (the registrar checks again: refused if it does not fit
        on its own, else tried again once the ones before it have committed). So registrations
        of one owner queued together commit together instead of each failing on those committed
        since it read, and the quota holds for their sum. Returns the conflicts by registration
        ``id``."""
        owners = sorted({r.record.owner for r in chunk if r.prepared.usage is not None})
        if not owners:
            return {}
        _, responses = self._txn(
            compare=[],
            success=[
                etcd_ops.get(self.keys.usage(o).encode(), prefix_end(self.keys.usage(o))) for o in owners
            ],
            failure=[],
            what="read the owners' usage",
        )
        usage = {
            owner: StorageUsage.of_entries((value, kv.create_revision) for value, kv in entries)
            for owner, entries in zip(owners, responses, strict=True)
        }
        taken = {owner: (0, 0) for owner in owners}  # adapters and bytes of those before, by owner
        conflicts: dict[int, Exception] = {}
        for registration in chunk:
            owner = registration.record.owner
            if registration.prepared.usage is None:
                continue
            registration.prepared = replace(registration.prepared, usage=usage[owner])
            adapters, added_bytes = registration.delta()
            before_adapters, before_bytes = taken[owner]
            if fits(
                registration.limits, usage[owner], before_adapters + adapters, before_bytes + added_bytes
            ):
                taken[owner] = (before_adapters + adapters, before_bytes + added_bytes)
            else:
                # Against the usage committed, not the ones before it here: it is refused only
                # if it does not fit on its own, else tried again once those have committed.
                conflicts[id(registration)] = CatalogConflict(
                    f"{owner}/{registration.record.name}", registration.prepared
                )
        return conflicts

    def _commit_alone(self, registration: _Registration) -> Exception | None:
        record, prepared, replacing = registration.record, registration.prepared, registration.replacing
        with_usage = prepared.usage is not None
        reads = self._state_reads(record.owner, record.name, set(prepared.blobs), with_usage)
        try:
            succeeded, responses = self._txn(
                compare=registration.compare(self.keys),
                success=registration.ops(self.keys),
                failure=reads,
                what="commit a registration",
            )
        except Unavailable as error:
            return error
        if succeeded:
            registration.committed = _revision(responses[0])
            return None
        fresh = self._prepared(responses, set(prepared.blobs), with_usage)
        if fresh.serving_id and (replacing is None or fresh.serving_id != replacing.id):
            return DuplicateName(f"{record.owner}/{record.name}", fresh.serving_id)
        return CatalogConflict(f"{record.owner}/{record.name}", fresh)

    def import_row(self, record: AdapterRecord, last_version: int) -> str:
        """Commit a row migrated from elsewhere with its own id and version (its blobs already
        published); "" when it is in the catalog now (or was already), else why not."""
        t = aetcd.transactions
        row_key = self.keys.row(record.id).encode()
        name_key = self.keys.name(record.owner, record.name).encode()
        success = [
            t.Put(row_key, encode_row(record)),
            t.Put(name_key, record.id.encode()),
            t.Put(self.keys.version(record.owner, record.name).encode(), str(last_version).encode()),
            *(t.Put(self.keys.ref(d, record.id).encode(), b"") for d in set(record_digests(record).values())),
            usage_put(self.keys, record),
        ]
        succeeded, responses = self._txn(
            compare=[t.Version(row_key) == 0, t.Create(name_key) == 0],
            success=success,
            failure=[t.Get(row_key)],
            what="migrate a row",
        )
        if succeeded:
            self._await_mirror(lambda: self.mirror.get(record.id) is not None, f"adapter {record.id}")
            return ""
        return "" if responses and responses[0] else "its name is taken by another adapter in etcd"

    # -- other writes --

    def delete(self, record: AdapterRecord) -> bool:
        """Remove ``record``'s row, name and references, after its name's kept versions (a
        deletion cut short leaves the name serving); False when it was gone already."""
        t = aetcd.transactions
        row_key = self.keys.row(record.id).encode()
        kept = [other for other in self.mirror.versions(record.owner, record.name) if other.id != record.id]
        for ops in kept_removals(self.keys, kept):
            self._txn(compare=[], success=ops, failure=[], what="delete versions")
        succeeded, _ = self._txn(
            compare=[t.Version(row_key) > 0],
            success=row_removal(self.keys, record, True),
            failure=[],
            what="delete an adapter",
        )
        if succeeded:
            self._await_mirror(
                lambda: all(self.mirror.get(r.id) is None for r in (record, *kept)),
                f"adapter {record.id} deleted",
            )
        return succeeded

    def set_pinned(self, record: AdapterRecord, pinned: bool) -> bool:
        """Rewrite ``record``'s row with ``pinned``; False when it is no longer in the catalog."""
        t = aetcd.transactions
        row_key = self.keys.row(record.id).encode()
        succeeded, _ = self._txn(
            compare=[t.Version(row_key) > 0],
            success=[t.Put(row_key, encode_row(replace(record, pinned=pinned)))],
            failure=[],
            what="pin an adapter",
        )
        if succeeded:
            self._await_mirror(
                lambda: _pinned(self.mirror.get(record.id)) in (pinned, None), f"adapter {record.id} pinned"
            )
        return succeeded

    # -- the collector's marks --

    def mark_collecting(self, digest: str) -> int:
        """Mark blob ``digest`` ``collecting`` if no row references it, in one transaction with
        that check; returns the mark's revision, 0 when it may not be collected now."""
        t = aetcd.transactions
        mark_key = self.keys.blob_mark(digest).encode()
        refs = self.keys.refs(digest)
        found = self._get(mark_key, "read a blob mark")
        mark = BlobMark("collecting", int(time.time() * 1000), self.replica_id)
        succeeded, responses = self._txn(
            compare=[
                t.Mod(mark_key) == (found.mod_revision if found else 0),
                t.Version(refs.encode(), range_end=prefix_end(refs)) == 0,
            ],
            success=[t.Put(mark_key, mark.encode())],
            failure=[],
            what="mark a blob for collection",
        )
        return _revision(responses[0]) if succeeded else 0

    def mark_collected(self, digest: str, mark_revision: int) -> bool:
        """Record that blob ``digest`` was deleted under the mark set at ``mark_revision``; False
        when a registration took the mark over meanwhile (it found the mark abandoned)."""
        t = aetcd.transactions
        mark_key = self.keys.blob_mark(digest).encode()
        mark = BlobMark("collected", int(time.time() * 1000), self.replica_id)
        succeeded, _ = self._txn(
            compare=[t.Mod(mark_key) == mark_revision],
            success=[t.Put(mark_key, mark.encode())],
            failure=[],
            what="record a collected blob",
        )
        return succeeded

    def still_marked(self, digest: str, mark_revision: int) -> bool:
        """Whether the collector's mark set at ``mark_revision`` still stands."""
        found = self._get(self.keys.blob_mark(digest).encode(), "read a blob mark")
        return found is not None and found.mod_revision == mark_revision


def _pinned(record: AdapterRecord | None) -> bool | None:
    return None if record is None else record.pinned


def _revision(response: Any) -> int:
    """The revision a transaction's put or delete was committed at."""
    which = response.WhichOneof("response")
    return getattr(response, which).header.revision
