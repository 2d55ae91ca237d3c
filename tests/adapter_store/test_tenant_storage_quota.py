"""Quotas on what a tenant stores (adapters, bytes) and uploads at once, on a real etcd and a real
blob directory: a refusal is RESOURCE_EXHAUSTED naming the limit and leaves no row, no usage and
no blob behind; replicas racing for a tenant's last room let exactly one in; a deletion frees room."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import pytest
from support.cli import COMMAND_TIMEOUT_S  # a hang guard, not a timing claim
from support.polling import poll_until

from mesh_api.adapter_transfer import upload_requests
from services.adapter_store.adapter_record import PRIVATE
from services.adapter_store.blobs.local_directory import LocalDirectoryBlobs
from services.adapter_store.catalog_keys import record_digests
from services.adapter_store.registrar import AdapterUpload
from services.adapter_store.repository import AdapterKey
from services.adapter_store.storage_usage import stored_bytes
from services.runtime.errors import ResourceExhausted
from services.runtime.tenants_file import QuotaConfig, TenantLimits

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def upload(files, name, owner="alice") -> AdapterUpload:
    return AdapterUpload(name, owner, PRIVATE, files[CONFIG], files[WEIGHTS])


def size(files) -> int:
    """What an adapter of these files stores (no chat template)."""
    return len(files[CONFIG]) + len(files[WEIGHTS])


def tenants(**alice) -> QuotaConfig:
    return QuotaConfig({"alice": TenantLimits(**alice)})


def blob_files(root: Path) -> set[str]:
    return {path.name for path in (root / "sha256").glob("*")}


def staged_files(root: Path) -> list[Path]:
    return list((root / "staging").glob("*"))


class GatedBlobs(LocalDirectoryBlobs):
    """A blob directory whose next flush (the one just before a group of registrations commits)
    waits at ``gate`` once armed: registrations meant to race are held there until all of them
    have published their blobs."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.gate: threading.Barrier | threading.Event | None = None

    def flush(self) -> None:
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.wait(COMMAND_TIMEOUT_S)
        super().flush()


def test_past_its_count_a_tenants_upload_is_refused_and_a_deletion_frees_room(open_repository, seeded_files):
    repository = open_repository(tenants=tenants(max_adapters=2))
    for i in range(2):
        repository.registrar.register(upload(seeded_files(i), f"a{i}"))
    with pytest.raises(ResourceExhausted) as refused:
        repository.registrar.register(upload(seeded_files(2), "a2"))
    assert refused.value.message == (
        "tenant 'alice' stores 2 adapters, its limit (max_adapters 2): delete one before adding "
        f"adapter 'a2' ({size(seeded_files(2))} bytes)"
    )
    assert "\n" not in refused.value.message
    # Another tenant's uploads go on; the refused one left no row.
    repository.registrar.register(upload(seeded_files(2), "a2", owner="bob"))
    assert repository.catalog.get_by_name("alice", "a2") is None
    repository.delete(AdapterKey(owner="alice", name="a0"))
    repository.registrar.register(upload(seeded_files(2), "a2"))
    usage = repository.catalog.usage("alice")
    assert (usage.adapters, usage.bytes) == (2, size(seeded_files(1)) + size(seeded_files(2)))


def test_past_its_byte_quota_a_tenants_upload_is_refused_and_the_store_holds_nothing_of_it(
    open_repository, seeded_files, tmp_path
):
    first, second = seeded_files(10), seeded_files(11)
    repository = open_repository(tenants=tenants(max_stored_bytes=size(first) + size(second) - 1))
    record = repository.registrar.register(upload(first, "first"))
    assert stored_bytes(record) == size(first)
    blobs, usage = blob_files(tmp_path / "store"), repository.catalog.usage("alice")
    with pytest.raises(ResourceExhausted) as refused:
        repository.registrar.register(upload(second, "second"))
    assert refused.value.message == (
        f"adapter 'second' ({size(second)} bytes) would take tenant 'alice' to "
        f"{size(first) + size(second)} stored bytes, past its limit (max_stored_bytes "
        f"{size(first) + size(second) - 1}; {size(first)} stored now)"
    )
    assert refused.value.retry_after_s is None  # only a deletion makes room
    assert blob_files(tmp_path / "store") == blobs and not staged_files(tmp_path / "store")
    assert repository.catalog.usage("alice") == usage
    assert [r.name for r in repository.catalog.all()] == ["first"]


def test_two_replicas_racing_for_a_tenants_last_room_let_exactly_one_in_and_the_other_leaves_no_blob(
    open_repository, seeded_files, tmp_path
):
    root = tmp_path / "store"
    gated = [GatedBlobs(root), GatedBlobs(root)]
    replicas = [open_repository(blobs=blobs, replica_id=f"r{i}", tenants=tenants(max_adapters=1)) for i, blobs in enumerate(gated)]  # fmt: skip
    both_published = threading.Barrier(2)
    for blobs in gated:
        blobs.gate = both_published  # each passed every check and published before either commits
    outcomes: dict[int, str] = {}

    def register(i: int) -> None:
        try:
            replicas[i].registrar.register(upload(seeded_files(20 + i), f"n{i}"))
            outcomes[i] = "ok"
        except ResourceExhausted as error:
            outcomes[i] = error.message

    threads = [threading.Thread(target=register, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(COMMAND_TIMEOUT_S)
    assert list(outcomes.values()).count("ok") == 1, outcomes
    winner = next(i for i, outcome in outcomes.items() if outcome == "ok")
    assert outcomes[1 - winner].startswith("tenant 'alice' stores 1 adapter, its limit (max_adapters 1)")
    [record] = replicas[0].catalog.all()
    assert record.name == f"n{winner}" and replicas[1].catalog.usage("alice").adapters == 1
    # The loser had published its weights: it took them back.
    assert blob_files(root) == set(record_digests(record).values()) and not staged_files(root)


def test_registrations_of_one_tenant_committing_together_must_fit_together(
    open_repository, seeded_files, tmp_path
):
    blobs = GatedBlobs(tmp_path / "store")
    repository = open_repository(blobs=blobs, tenants=tenants(max_adapters=1))
    release = threading.Event()
    blobs.gate = release  # bob's commit holds the group commit while alice's two queue behind it
    outcomes: list[str] = []

    def register(files, name, owner) -> None:
        try:
            repository.registrar.register(upload(files, name, owner))
            outcomes.append("ok")
        except ResourceExhausted:
            outcomes.append("refused")

    threads = [threading.Thread(target=register, args=(seeded_files(30), "b", "bob"))]
    threads[0].start()
    asyncio.run(poll_until(_async(lambda: blobs.gate), lambda gate: gate is None, "bob's commit at the gate"))
    for i in range(2):
        threads.append(threading.Thread(target=register, args=(seeded_files(31 + i), f"a{i}", "alice")))
        threads[-1].start()
    asyncio.run(
        poll_until(_async(lambda: repository.catalog._commits.queued), lambda n: n == 2, "alice's two queued")
    )
    release.set()
    for thread in threads:
        thread.join(COMMAND_TIMEOUT_S)
    assert sorted(outcomes) == ["ok", "ok", "refused"]
    assert repository.catalog.usage("alice").adapters == 1


def _async(fetch):
    async def fetched():
        return fetch()

    return fetched


def test_a_new_version_counts_its_difference_and_an_import_of_the_same_content_nothing(
    open_repository, seeded_files
):
    files = seeded_files(40)
    repository = open_repository(tenants=tenants(max_adapters=1, max_stored_bytes=size(files)))
    repository.registrar.register_version(upload(files, "a"))
    assert not repository.registrar.register_version(upload(files, "a")).changed  # at its limits
    again = repository.registrar.register_version(upload(seeded_files(41), "a"))  # same size
    assert again.changed and again.record.version == 2
    assert repository.catalog.usage("alice").adapters == 1
    with pytest.raises(ResourceExhausted, match="max_adapters 1"):
        repository.registrar.register_version(upload(files, "b"))


def test_uploads_in_flight_are_bounded_across_replicas(open_repository):
    limits = QuotaConfig({"alice": TenantLimits(max_concurrent_uploads=2)})
    one, two = (
        open_repository(replica_id="r1", tenants=limits),
        open_repository(replica_id="r2", tenants=limits),
    )
    held = [one.quota.admit("alice", True), two.quota.admit("alice", True)]
    with pytest.raises(ResourceExhausted) as refused:
        two.quota.admit("alice", True)
    assert refused.value.message == (
        "tenant 'alice' has 2 uploads and imports in flight, its limit (max_concurrent_uploads 2); "
        "retry once one of them has ended"
    )
    assert refused.value.retry_after_s == 1.0
    one.quota.admit("bob", True).release()  # other tenants are not bounded
    held[0].release()
    held[0].release()  # a second release frees nothing more
    held.append(one.quota.admit("alice", True))
    with pytest.raises(ResourceExhausted):
        one.quota.admit("alice", True)
    for admission in held:
        admission.release()


def test_rows_without_usage_entries_get_them_and_stale_entries_go_when_a_replica_opens(
    open_repository, seeded_files
):
    repository = open_repository()
    record = repository.registrar.register(upload(seeded_files(50), "a"))
    keys = repository.catalog.keys
    entry = keys.usage_entry("alice", record.id).encode()
    stale = keys.usage_entry("alice", "gone").encode()

    async def rewrite(client):
        await client.delete(entry)  # as a catalog written before usage entries existed
        await client.put(stale, b"123")  # as a row deleted by a replica of that time

    repository.catalog.etcd_call(rewrite, "rewrite usage")
    assert (repository.catalog.usage("alice").adapters, repository.catalog.usage("alice").bytes) == (1, 123)
    assert open_repository(replica_id="r2").catalog.usage("alice").bytes == stored_bytes(record)


@pytest.mark.store_config(
    tenants={
        "alice": {"max_adapters": 1},
        "bob": {"max_stored_bytes": 1000},
        "carol": {"max_concurrent_uploads": 1},
    }
)
def test_over_quota_uploads_are_resource_exhausted_in_one_line_and_leave_no_trace(
    store_stub, store_server, seeded_files, traces
):
    files = seeded_files(60)
    store_stub.RegisterAdapter(upload_requests(files, "a", "alice"), timeout=COMMAND_TIMEOUT_S)
    before = traces(store_server)
    for owner, limit in (("alice", "(max_adapters 1)"), ("bob", "(max_stored_bytes 1000; 0 stored now)")):
        with pytest.raises(grpc.RpcError) as refused:  # at the header, or as the weights arrive
            store_stub.RegisterAdapter(
                upload_requests(seeded_files(61), "b", owner), timeout=COMMAND_TIMEOUT_S
            )
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert limit in refused.value.details() and "\n" not in refused.value.details()
    assert traces(store_server) == before
    held = store_server.service.repository.quota.admit("carol", True)  # carol's one upload in flight
    with pytest.raises(grpc.RpcError) as refused:
        store_stub.RegisterAdapter(upload_requests(files, "c", "carol"), timeout=COMMAND_TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_concurrent_uploads 1" in refused.value.details()
    assert dict(refused.value.trailing_metadata())["retry-after-s"] == "1.000"
    held.release()
    store_stub.RegisterAdapter(upload_requests(files, "c", "carol"), timeout=COMMAND_TIMEOUT_S)
