"""Several store replicas on one etcd and one blob directory: they agree on every name, a blob
a committed row names is never collected, and a replica cut off from etcd refuses writes but
goes on serving what it holds."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
from support.cli import COMMAND_TIMEOUT_S  # a hang guard, not a timing claim
from support.polling import HANG_GUARD_S  # a hang guard: the answer is local and immediate

from services.adapter_store import registrar as registrar_module
from services.adapter_store.adapter_record import PRIVATE
from services.adapter_store.registrar import AdapterUpload
from services.adapter_store.repository import AdapterKey
from services.runtime.errors import AlreadyExists, Unavailable
from services.runtime.etcd import prefix_follower

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
HOUR = 3600.0


def upload(files, name, owner="alice") -> AdapterUpload:
    return AdapterUpload(name, owner, PRIVATE, files[CONFIG], files[WEIGHTS])


def test_concurrent_registrations_of_one_name_on_two_replicas_leave_exactly_one(
    open_repository, seeded_files
):
    replicas = [open_repository(replica_id="r1"), open_repository(replica_id="r2")]
    outcomes: list[str] = []
    start = threading.Barrier(8)

    def register(i: int) -> None:
        start.wait(COMMAND_TIMEOUT_S)
        try:
            replicas[i % 2].registrar.register(upload(seeded_files(i % 3), "same"))
            outcomes.append("ok")
        except AlreadyExists:
            outcomes.append("exists")

    threads = [threading.Thread(target=register, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(COMMAND_TIMEOUT_S)
    assert sorted(outcomes) == ["exists"] * 7 + ["ok"]
    first, second = (r.resolve(AdapterKey(owner="alice", name="same")) for r in replicas)
    assert first == second and first.version == 1
    assert [r.catalog.count() for r in replicas] == [1, 1]


def test_each_replica_sees_the_others_writes_in_order(open_repository, seeded_files):
    one, two = open_repository(replica_id="r1"), open_repository(replica_id="r2")
    changes = []
    two.changes.subscribe(changes.append)
    a = one.registrar.register(upload(seeded_files(0), "a"))
    b = one.registrar.register_version(upload(seeded_files(1), "a")).record
    assert b.version == 2
    # Read from the other replica at once: its copy may lag, its lookups ask etcd on a miss.
    assert two.resolve(AdapterKey(id=b.id)) == b
    assert bytes(two.read_weights(b)) == seeded_files(1)[WEIGHTS]
    one.delete(AdapterKey(id=b.id))
    assert two.catalog.mirror.wait_until(
        lambda: two.catalog.mirror.versions("alice", "a") == [], COMMAND_TIMEOUT_S
    )
    kinds = [("up", c.upserted.id) if c.upserted else ("del", c.deleted_id) for c in changes]
    # a stays, a kept version of the name, until the name is deleted (its kept versions first).
    assert kinds == [("up", a.id), ("up", b.id), ("del", a.id), ("del", b.id)]


def test_a_publish_the_other_replica_committed_meanwhile_is_kept_not_copied_as_a_new_version(
    open_repository, seeded_files
):
    """A publish retried on the other replica (this one slow, or stopped and resumed, before its
    commit) while this one is still on it: the commit that comes second finds the name serving
    this very content and keeps it, as a publish of what the name serves does: no second
    version of the same content."""
    one, two = open_repository(replica_id="r1"), open_repository(replica_id="r2")
    first = one.registrar.register_version(upload(seeded_files(0), "a")).record
    publish, retried = one.registrar._publish, []

    def publish_after_the_retry(record, publication):
        if not retried:  # between this replica's prepare and its commit
            retried.append(two.registrar.register_version(upload(seeded_files(1), "a")))
        publish(record, publication)

    one.registrar._publish = publish_after_the_retry
    late = one.registrar.register_version(upload(seeded_files(1), "a"))
    assert retried[0].changed and retried[0].record.version == 2
    assert not late.changed and (late.record.id, late.record.version) == (retried[0].record.id, 2)
    for replica in (one, two):  # each copy may lag on the other's commit; a copy would be its own
        mirror = replica.catalog.mirror
        assert mirror.wait_until(lambda m=mirror: len(m.versions("alice", "a")) >= 2, COMMAND_TIMEOUT_S)
        assert sorted((v.version, v.id) for v in mirror.versions("alice", "a")) == [
            (1, first.id),
            (2, late.record.id),
        ]


def test_a_blob_being_collected_is_written_again_before_a_registration_relies_on_it(
    open_repository, seeded_files, monkeypatch
):
    """The collector marks an unreferenced blob, then deletes it, after a registration of the
    same bytes found the blob present (and published nothing) but before it commits: the commit
    is refused (the mark changed), and the registration writes the blob again, then commits."""
    now = [time.time()]
    collector_side = open_repository(replica_id="collector", clock=lambda: now[0])
    registering = open_repository(replica_id="registrar")
    old = collector_side.registrar.register(upload(seeded_files(0), "old"))
    collector_side.delete(AdapterKey(id=old.id))
    now[0] += 2 * HOUR

    commit = registering.catalog.commit
    collected: list[int] = []

    def collect_then_commit(*args, **kwargs):
        if not collected:  # the collector runs between the publication and the commit
            collected.append(collector_side.collector.collect())
        return commit(*args, **kwargs)

    monkeypatch.setattr(registering.catalog, "commit", collect_then_commit)
    record = registering.registrar.register(upload(seeded_files(0), "new"))
    assert collected == [2]  # the weights and the config: nothing referenced them
    assert record.sha256 == old.sha256
    assert bytes(registering.read_weights(record)) == seeded_files(0)[WEIGHTS]
    now[0] += 2 * HOUR
    assert collector_side.collector.collect() == 0  # referenced now


def test_a_collection_mark_left_by_a_dead_replica_stops_no_registration_for_long(
    open_repository, seeded_files, monkeypatch
):
    now = [time.time()]
    dead = open_repository(replica_id="dead", clock=lambda: now[0])
    old = dead.registrar.register(upload(seeded_files(0), "old"))
    dead.delete(AdapterKey(id=old.id))
    assert dead.catalog.mark_collecting(old.sha256)  # ...and the replica dies before deleting
    alive = open_repository(replica_id="alive")
    now_s = [time.time()]
    waits: list[float] = []

    def wait(seconds: float) -> None:
        waits.append(seconds)
        now_s[0] += registrar_module.COLLECTOR_STALL_MS / 1000  # time passes while it waits

    monkeypatch.setattr(alive.registrar, "_sleep", wait)
    monkeypatch.setattr(alive.registrar, "_clock", lambda: now_s[0])
    record = alive.registrar.register(upload(seeded_files(0), "new"))
    assert len(waits) == 1 and bytes(alive.read_weights(record)) == seeded_files(0)[WEIGHTS]


@pytest.mark.integration
def test_a_replica_cut_off_from_etcd_refuses_writes_and_serves_what_it_holds(
    open_repository, seeded_files, etcd
):
    replica = open_repository(ram_budget_bytes=0)  # every read goes to the blob tier
    held = replica.registrar.register(upload(seeded_files(0), "held"))
    etcd.kill()
    try:
        with pytest.raises(Unavailable, match="etcd"):
            replica.registrar.register(upload(seeded_files(1), "new"))
        with pytest.raises(Unavailable, match="etcd"):
            replica.delete(AdapterKey(id=held.id))
        assert replica.resolve(AdapterKey(owner="alice", name="held")) == held
        assert bytes(replica.read_weights(held)) == seeded_files(0)[WEIGHTS]
        assert [r.name for r in replica.list("alice")[0]] == ["held"]
        assert "unreachable" in replica.catalog.problem
    finally:
        etcd.restart()
    again = replica.registrar.register(upload(seeded_files(1), "new"))
    assert replica.resolve(AdapterKey(id=again.id)) == again


def test_a_replica_lists_a_catalog_larger_than_one_read_page_by_page(
    open_repository, seeded_files, monkeypatch
):
    """10,000 rows are more than one gRPC reply holds: the listing is read in pages, at one
    revision."""
    monkeypatch.setattr(prefix_follower, "LIST_PAGE_ROWS", 2)
    writer = open_repository(replica_id="writer")
    records = [writer.registrar.register(upload(seeded_files(i % 2), f"a{i}")) for i in range(5)]
    reader = open_repository(replica_id="reader")
    assert reader.catalog.all() == records


@pytest.mark.integration
def test_a_replica_cut_off_from_etcd_says_in_its_readiness_that_it_refuses_writes(
    store_server, etcd, seeded_files
):
    """Ready still (it serves reads), and ``/readyz`` says why writes are refused."""

    def readiness() -> tuple[int, str]:
        with urllib.request.urlopen(
            f"http://{store_server.running.http_address}/readyz", timeout=HANG_GUARD_S
        ) as reply:
            return reply.status, reply.read().decode()

    assert readiness() == (200, "ready\n")
    etcd.kill()
    try:
        with pytest.raises(Unavailable, match="etcd"):
            store_server.service.repository.registrar.register(upload(seeded_files(0), "new"))
        status, body = readiness()
    finally:
        etcd.restart()
    assert status == 200
    assert body.startswith(f"ready, degraded: writes refused: etcd at {etcd.endpoint} unreachable")
