"""The store's RAM tier under an eviction policy (LRU, LFU) and pins, alone and through the
repository: a pinned adapter is never evicted, counts against the budget, and a pin that would
not fit is refused; pins survive a restart and a new version of the name."""

from __future__ import annotations

import pytest

from services.adapter_store.adapter_record import PRIVATE, PUBLIC
from services.adapter_store.ram_tier import RamTier
from services.adapter_store.registrar import AdapterUpload
from services.adapter_store.repository import AdapterKey, AdapterRepository
from services.runtime.errors import ResourceExhausted
from services.runtime.eviction import LFUEviction

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def test_lfu_keeps_the_frequently_used():
    tier = RamTier(budget_bytes=30, eviction=LFUEviction())
    for key in "abc":
        tier.put(key, b"x" * 10)
    for _ in range(2):
        tier.get("a")
    tier.get("b")
    tier.get("c")  # c is the most recent, but used as often as b, which is older...
    tier.get("c")  # ...and now more often: b goes
    tier.put("d", b"y" * 10)
    assert tier.get("b") is None and all(tier.get(k) is not None for k in "acd")


def test_a_pinned_entry_is_never_evicted_and_counts_against_the_budget():
    tier = RamTier(budget_bytes=30)
    tier.pin("a")
    for key in "abc":
        tier.put(key, b"x" * 10)
    tier.put("d", b"y" * 10)  # a is the least recently used, but pinned: b goes
    assert tier.get("a") is not None and tier.get("b") is None
    assert tier.put("big", b"z" * 25) is None  # fits only by evicting the pinned a: not kept
    assert tier.get("c") is not None and tier.get("d") is not None and tier.bytes_used == 30
    tier.unpin("a")
    tier.put("e", b"w" * 10)
    assert tier.get("a") is None


@pytest.fixture
def repo(open_repository, seeded_files):
    """A repository whose RAM holds one sample adapter (LFU order)."""
    size = len(seeded_files(0)[WEIGHTS])

    def open_repo() -> AdapterRepository:
        return open_repository(ram_budget_bytes=int(size * 1.5), eviction_policy="lfu")

    repository = open_repo()
    repository.reopen = open_repo
    return repository


def add(repo, files, name):
    return repo.registrar.register(AdapterUpload(name, "alice", PRIVATE, files[CONFIG], files[WEIGHTS]))


def test_a_pinned_adapter_stays_in_ram_and_a_pin_over_the_budget_is_refused(repo, seeded_files):
    records = [add(repo, seeded_files(i), f"a{i}") for i in range(2)]
    pinned = repo.set_pinned(AdapterKey(owner="alice", name="a0"), True)
    assert pinned.pinned and repo.resolve(AdapterKey(id=records[0].id)).pinned
    with pytest.raises(ResourceExhausted, match="over the store's RAM budget"):
        repo.set_pinned(AdapterKey(id=records[1].id), True)
    for i in range(2, 5):
        add(repo, seeded_files(i), f"a{i}")
        repo.read_weights(repo.resolve(AdapterKey(owner="alice", name=f"a{i}")))
    misses = repo.ram.misses
    repo.read_weights(records[0])
    assert repo.ram.misses == misses  # served from RAM all along
    assert repo.pinned_ids() == [records[0].id]
    repo.set_pinned(AdapterKey(id=records[0].id), False)
    assert repo.pinned_ids() == []


def test_pins_survive_a_restart_and_a_new_version(repo, seeded_files):
    first = add(repo, seeded_files(0), "a0")
    repo.set_pinned(AdapterKey(id=first.id), True)
    repo.close()
    reopened = repo.reopen()
    try:
        assert reopened.pinned_ids() == [first.id]
        # A new version (here: the same files made public) is pinned in the old one's place.
        second = reopened.registrar.register_version(
            AdapterUpload("a0", "alice", PUBLIC, seeded_files(0)[CONFIG], seeded_files(0)[WEIGHTS])
        )
        assert second.changed and second.record.pinned and reopened.pinned_ids() == [second.record.id]
        for i in range(1, 4):  # each read would evict the pinned one, were it not pinned
            reopened.read_weights(add(reopened, seeded_files(i), f"a{i}"))
        misses = reopened.ram.misses
        reopened.read_weights(second.record)
        assert reopened.ram.misses == misses
    finally:
        reopened.close()
