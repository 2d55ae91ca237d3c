"""The store's paths that must not grow with the number of adapters (issue 30): a reopen that
reads no blob (each is verified when first read, corruption still caught before it is served),
concurrent registrations, paging while adapters come and go, and the change feed gateways index
from."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
import pytest
from support.cli import COMMAND_TIMEOUT_S

from mesh_api.adapter_transfer import upload_requests
from mesh_api.v1 import adapter_store_pb2 as pb
from services.adapter_store import repository as repository_module
from services.adapter_store.adapter_record import PRIVATE, PUBLIC
from services.adapter_store.blobs.local_directory import LocalDirectoryBlobs
from services.adapter_store.catalog_changes import CatalogChange
from services.adapter_store.group_commit import GroupCommit
from services.adapter_store.registrar import AdapterUpload
from services.adapter_store.repository import AdapterKey, AdapterRepository
from services.runtime.errors import AlreadyExists, DataLoss, NotFound

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
WEIGHTS_BYTES = 64 << 10
"""Larger than any config, smaller than any adapter's weights here."""


@pytest.fixture
def open_repo(open_repository):
    def open_repo(verify: str = "size") -> AdapterRepository:
        return open_repository(verify_on_open=verify)

    return open_repo


def add(repo, files, name, visibility=PRIVATE):
    return repo.registrar.register(AdapterUpload(name, "alice", visibility, files[CONFIG], files[WEIGHTS]))


@pytest.fixture
def work_done(monkeypatch):
    """Counts of sha256 computations and blob reads of weights (``WEIGHTS_BYTES`` or more; the
    small config blobs rows name are read once per distinct content), from now on."""
    counts = {"sha256": 0, "reads": 0}
    hash_blob, read_blob = repository_module.sha256_hex, LocalDirectoryBlobs.get

    def counting_hash(data):
        counts["sha256"] += len(data) >= WEIGHTS_BYTES
        return hash_blob(data)

    def counting_read(self, digest):
        data = read_blob(self, digest)
        counts["reads"] += len(data) >= WEIGHTS_BYTES
        return data

    monkeypatch.setattr(repository_module, "sha256_hex", counting_hash)
    monkeypatch.setattr(LocalDirectoryBlobs, "get", counting_read)
    return counts


def test_a_reopen_reads_no_blob_however_many_there_are(open_repo, sample_files, work_done):
    repo = open_repo()
    records = [add(repo, sample_files, f"a{i}") for i in range(24)]
    repo.close()
    work_done.update(sha256=0, reads=0)
    again = open_repo()
    assert again.stats().adapters == 24
    assert work_done == {"sha256": 0, "reads": 0}
    again.read_weights(again.resolve(AdapterKey(id=records[5].id)))
    again.read_weights(again.resolve(AdapterKey(id=records[5].id)))  # verified once, then from RAM
    assert work_done == {"sha256": 1, "reads": 1}
    again.close()
    work_done.update(sha256=0, reads=0)
    open_repo(verify="sha256")  # the operator's choice: everything, before serving
    assert work_done == {"sha256": 24, "reads": 24}


def test_a_blob_corrupted_on_disk_is_caught_on_its_first_read_and_quarantined(open_repo, seeded_files):
    repo = open_repo()
    good, bad = add(repo, seeded_files(0), "good"), add(repo, seeded_files(1), "bad")
    repo.close()
    path = repo.blobs.path(bad.sha256)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # same size: only the hash can tell
    path.write_bytes(bytes(raw))
    again = open_repo()
    changes: list[CatalogChange] = []
    again.changes.subscribe(changes.append)
    assert again.stats().adapters == 2  # not read at open
    with pytest.raises(DataLoss, match="sha256"):
        again.read_weights(again.resolve(AdapterKey(id=bad.id)))
    assert again.ram.get(bad.sha256) is None  # nothing of it served or cached
    with pytest.raises(NotFound):
        again.resolve(AdapterKey(id=bad.id))
    assert not path.exists()  # registering the same weights again writes them afresh
    assert changes == [CatalogChange(deleted_id=bad.id)]
    assert again.read_weights(again.resolve(AdapterKey(id=good.id))) == seeded_files(0)[WEIGHTS]
    assert again.stats().disk_bytes == good.size_bytes


def test_a_page_token_stays_valid_while_adapters_come_and_go(open_repo, sample_files):
    repo = open_repo()
    for i in range(7):
        add(repo, sample_files, f"n{i}")
    first, token, total = repo.list("alice", page_size=3)
    assert [r.name for r in first] == ["n0", "n1", "n2"] and total == 7
    repo.delete(AdapterKey(owner="alice", name="n4"))
    add(repo, sample_files, "n7")
    repo.registrar.register_version(
        AdapterUpload("n1", "alice", PUBLIC, sample_files[CONFIG], sample_files[WEIGHTS])
    )
    names = []
    while token:
        page, token, _ = repo.list("alice", page_size=3, page_token=token)
        names += [r.name for r in page]
    # Registration order: the new version of n1 comes after everything registered before it.
    assert names == ["n3", "n5", "n6", "n7", "n1"]


def test_the_change_feed_follows_every_commit_in_order(open_repo, sample_files):
    repo = open_repo()
    changes: list[CatalogChange] = []
    unsubscribe = repo.changes.subscribe(changes.append)
    a = add(repo, sample_files, "a")
    b = repo.registrar.register_version(
        AdapterUpload("a", "alice", PUBLIC, sample_files[CONFIG], sample_files[WEIGHTS])
    ).record
    same = repo.registrar.register_version(
        AdapterUpload("a", "alice", PUBLIC, sample_files[CONFIG], sample_files[WEIGHTS])
    )
    with pytest.raises(AlreadyExists):
        add(repo, sample_files, "a")
    repo.delete(AdapterKey(id=b.id))
    unsubscribe()
    add(repo, sample_files, "after")
    assert not same.changed
    assert changes == [
        CatalogChange(upserted=a),
        CatalogChange(upserted=b),  # a stays, a kept version of the name
        CatalogChange(deleted_id=a.id),  # deleted with its name, first
        CatalogChange(deleted_id=b.id),
    ]


class WatchedLock(threading.Condition):
    """A stand-in for GroupCommit's queue lock that wakes its waiters each time it is released,
    so a test can wait for a state of the queue (read under this lock) without sleeping."""

    def __init__(self) -> None:
        super().__init__(threading.Lock())

    def __exit__(self, *exc_info):
        self.notify_all()
        return super().__exit__(*exc_info)


def start_queued(threads: list[threading.Thread], queue_lock: WatchedLock, queued: Callable[[], int]) -> None:
    """Start ``threads``, each submitting one item, and wait until ``queued()`` (read under the
    queue lock) counts them all."""
    for thread in threads:
        thread.start()
    with queue_lock:
        assert queue_lock.wait_for(lambda: queued() >= len(threads), COMMAND_TIMEOUT_S), (
            f"{queued()} of {len(threads)} submissions queued after {COMMAND_TIMEOUT_S} s"
        )


def flushed(commits: GroupCommit) -> Callable[[], int]:
    """How many items wait for the next commit, flushed."""
    return lambda: sum(len(batch) for _, batch in commits._flushed)


def join_all(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(COMMAND_TIMEOUT_S)
        assert not thread.is_alive(), f"a submission still running after {COMMAND_TIMEOUT_S} s"


def test_group_commit_runs_everything_queued_behind_a_batch_as_one_batch():
    release, first_running = threading.Event(), threading.Event()
    batches: list[list[str]] = []

    def apply(items):
        batches.append(list(items))
        if items == ["first"]:
            first_running.set()
            release.wait()
        return [ValueError(i) if i == "bad" else None for i in items]

    commits: GroupCommit[str] = GroupCommit(apply)
    commits._queue_lock = queue_lock = WatchedLock()
    outcomes: dict[str, str] = {}

    def submit(item: str) -> None:
        try:
            commits.submit(item)
            outcomes[item] = "ok"
        except ValueError:
            outcomes[item] = "refused"

    first = threading.Thread(target=submit, args=("first",), daemon=True)
    others = [threading.Thread(target=submit, args=(i,), daemon=True) for i in ("b", "bad", "d")]
    first.start()
    try:
        # The hang guards below are not timing claims: they only name a wait that never ends.
        assert first_running.wait(COMMAND_TIMEOUT_S), "the first batch never started"
        assert batches == [["first"]]  # the first batch runs, and holds the commit...
        start_queued(others, queue_lock, flushed(commits))  # ...while the others queue behind it
    finally:
        release.set()
    join_all([first, *others])
    assert batches[0] == ["first"] and sorted(batches[1]) == ["b", "bad", "d"] and commits.batches == 2
    assert outcomes == {"first": "ok", "b": "ok", "bad": "refused", "d": "ok"}


def test_group_commit_flushes_the_next_batch_while_one_commits():
    """A batch's flush overlaps the commit of the batch before it; an item is applied only after
    its own batch's flush."""
    release, first_applying, second_flushed = threading.Event(), threading.Event(), threading.Event()
    events: list = []

    def flush():
        events.append("flush")
        if events.count("flush") == 2:
            second_flushed.set()

    def apply(items):
        events.append(list(items))
        if items == ["first"]:
            first_applying.set()
            release.wait()
        return [None] * len(items)

    commits: GroupCommit[str] = GroupCommit(apply, flush)
    first = threading.Thread(target=commits.submit, args=("first",), daemon=True)
    second = threading.Thread(target=commits.submit, args=("second",), daemon=True)
    first.start()
    try:
        assert first_applying.wait(COMMAND_TIMEOUT_S), "the first batch never committed"
        second.start()
        assert second_flushed.wait(COMMAND_TIMEOUT_S), "the second batch waited for the first's commit"
    finally:
        release.set()
    join_all([first, second])
    assert events == ["flush", ["first"], "flush", ["second"]] and commits.batches == 2


def test_a_failed_flush_fails_its_batch_and_commits_nothing_of_it():
    failures = [OSError("no space left on the blob directory")]
    applied: list[str] = []

    def flush():
        if failures:
            raise failures.pop()

    def apply(items):
        applied.extend(items)
        return [None] * len(items)

    commits: GroupCommit[str] = GroupCommit(apply, flush)
    with pytest.raises(OSError, match="no space left"):
        commits.submit("a")
    commits.submit("b")
    assert applied == ["b"] and commits.queued == 0


def test_concurrent_registrations_commit_together_and_a_duplicate_alone_is_refused(open_repo, sample_files):
    repo = open_repo()
    names = [f"c{i}" for i in range(6)] + ["c0"]
    outcomes: list[str] = []

    def register(name: str) -> None:
        try:
            add(repo, sample_files, name)
            outcomes.append("ok")
        except AlreadyExists:
            outcomes.append("duplicate")

    threads = [threading.Thread(target=register, args=(n,)) for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["duplicate"] + ["ok"] * 6
    assert repo.catalog.count() == 6 and len(list(repo.blobs.listing())) == 2  # one weights, one config
    assert list(repo.blobs.staging_dir.iterdir()) == []


@pytest.mark.store_config(grace_s=60)
def test_shutdown_ends_the_catalog_watches_instead_of_waiting_out_its_grace(
    store_server, store_stub, sample_files
):
    store_stub.RegisterAdapter(upload_requests(sample_files, "a", "alice"), timeout=COMMAND_TIMEOUT_S)
    stream = store_stub.WatchAdapters(pb.WatchAdaptersRequest())
    first = next(stream)
    assert first.synced and [a.name for a in first.upserted] == ["a"]
    store_server.run(store_server.running.shutdown())  # graceful: what SIGTERM does
    # Ended by the store (OK), not cancelled when the 60 s grace ran out (CANCELLED).
    assert list(stream) == [] and stream.code() == grpc.StatusCode.OK


def test_registrations_too_many_for_one_transaction_commit_at_once_and_a_conflict_alone(
    open_repo, sample_files
):
    """40 registrations queued behind a batch: one batch, its three transactions (16, 16, 8)
    sent at once; the chunk whose name is taken in etcd (by a name key this replica's mirror
    does not know yet) falls back to one commit each, and only that name is refused."""
    repo = open_repo()
    catalog = repo.catalog
    taken = "n07"
    catalog.etcd_call(
        lambda c: c.put(catalog.keys.name("alice", taken).encode(), b"elsewhere"), "take a name"
    )
    release, holding = threading.Event(), threading.Event()
    flush = catalog._commits._flush

    def held_flush():
        if not holding.is_set():
            holding.set()
            assert release.wait(COMMAND_TIMEOUT_S), "the held batch was never released"
        flush()

    catalog._commits._flush = held_flush
    chunks: list[int] = []
    chunk_txn = catalog._chunk_txn

    def counting_chunk(chunk):
        chunks.append(len(chunk))
        return chunk_txn(chunk)

    catalog._chunk_txn = counting_chunk
    catalog._commits._queue_lock = queue_lock = WatchedLock()
    outcomes: dict[str, str] = {}

    def register(name: str) -> None:
        try:
            add(repo, sample_files, name)
            outcomes[name] = "ok"
        except AlreadyExists:
            outcomes[name] = "duplicate"

    first = threading.Thread(target=register, args=("first",), daemon=True)
    first.start()
    names = [f"n{i:02d}" for i in range(40)]
    threads = [threading.Thread(target=register, args=(name,), daemon=True) for name in names]
    try:
        assert holding.wait(COMMAND_TIMEOUT_S), "the first batch never started"
        start_queued(threads, queue_lock, lambda: len(catalog._commits._queue))
    finally:
        release.set()
    join_all([first, *threads])
    assert outcomes == {"first": "ok", **{name: "duplicate" if name == taken else "ok" for name in names}}
    assert catalog._commits.batches == 2 and sorted(chunks) == [8, 16, 16]
    assert {r.name for r in catalog.all()} == {"first", *names} - {taken}
