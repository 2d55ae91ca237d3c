"""The cluster prefix tier's index: longest leading run per holder, removal on eviction,
replacement, the per-worker bound and forgetting dead workers."""

from __future__ import annotations

import pytest

from services.kv_manager.prefix_index import PrefixHolder, PrefixIndex, PrefixIndexConfig
from services.runtime.errors import InvalidArgument

KEYS = [bytes([i]) * 32 for i in range(6)]


def test_the_longest_leading_run_wins_and_the_asker_is_never_its_own_holder():
    index = PrefixIndex()
    index.announce("w1", "m", KEYS[:2], [])
    index.announce("w2", "m", KEYS[:4], [])
    assert index.locate("w0", "m", KEYS) == PrefixHolder("w2", 4)
    assert index.locate("w2", "m", KEYS) == PrefixHolder("w1", 2)
    assert index.locate("w0", "m", KEYS[:2]) == PrefixHolder("w1", 2)  # a tie: the first by id
    assert index.locate("w0", "other-model", KEYS) == PrefixHolder("", 0)
    assert index.locate("w0", "m", [b"x" * 32, *KEYS]) == PrefixHolder("", 0)  # leading only


def test_evicted_replaced_and_dead_holders_are_forgotten():
    index = PrefixIndex()
    index.announce("w1", "m", KEYS[:4], [])
    assert index.announce("w1", "m", [], [KEYS[2]]) == 3
    assert index.locate("w0", "m", KEYS) == PrefixHolder("w1", 2)
    assert index.announce("w1", "m", KEYS[4:], [], replace=True) == 2
    assert index.locate("w0", "m", KEYS) == PrefixHolder("", 0)
    index.announce("w2", "m", KEYS, [])
    assert index.retain({"w1"}) == ["w2"]
    assert index.locate("w0", "m", KEYS) == PrefixHolder("", 0)
    assert len(index) == 2 and index.holders_by_worker() == {"w1": 2}


def test_entries_are_bounded_per_worker_and_calls_in_size():
    index = PrefixIndex(PrefixIndexConfig(max_blocks_per_worker=3, max_keys_per_call=6))
    assert index.announce("w1", "m", KEYS[:5], []) == 3  # the oldest two go
    assert index.locate("w0", "m", KEYS) == PrefixHolder("", 0)
    assert index.locate("w0", "m", KEYS[2:]) == PrefixHolder("w1", 3)
    with pytest.raises(InvalidArgument, match="7 keys in one call"):
        index.locate("w0", "m", KEYS + KEYS[:1])
    with pytest.raises(InvalidArgument, match="worker_id"):
        index.announce("", "m", KEYS, [])
    with pytest.raises(InvalidArgument, match="kv_identity"):
        index.announce("w1", "", KEYS, [])
