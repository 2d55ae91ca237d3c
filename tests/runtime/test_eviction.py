"""The eviction interface: LRU and FIFO order cached keys; the cache says which may go."""

from __future__ import annotations

import pytest

from services.runtime.eviction import FIFOEviction, LRUEviction, make_eviction_policy


def test_lru_evicts_the_least_recently_used_first():
    policy = LRUEviction()
    for key in ("a", "b", "c"):
        policy.touch(key)
    policy.touch("a")
    assert list(policy.victims(["a", "b", "c"])) == ["b", "c", "a"]
    assert policy.order() == ["b", "c", "a"]


def test_fifo_keeps_the_order_of_first_use():
    policy = FIFOEviction()
    for key in ("a", "b", "c", "a"):
        policy.touch(key)
    assert list(policy.victims(["a", "b", "c"])) == ["a", "b", "c"]


@pytest.mark.parametrize("policy", [LRUEviction(), FIFOEviction()])
def test_only_candidates_are_victims_and_removed_keys_are_forgotten(policy):
    for key in ("a", "b", "c"):
        policy.touch(key)
    policy.remove("b")
    policy.remove("unknown")  # ignored
    assert list(policy.victims(["c", "b"])) == ["c"]
    assert policy.order() == ["a", "c"]


def test_the_cache_may_evict_while_it_walks_the_victims():
    policy = LRUEviction()
    for key in range(4):
        policy.touch(key)
    walked = []
    for key in policy.victims(range(4)):
        policy.remove(key)
        walked.append(key)
        if len(walked) == 2:
            break
    assert walked == [0, 1] and policy.order() == [2, 3]


def test_policies_are_made_by_name():
    assert isinstance(make_eviction_policy("lru"), LRUEviction)
    assert isinstance(make_eviction_policy("fifo"), FIFOEviction)
    with pytest.raises(ValueError, match="known: fifo, lru"):
        make_eviction_policy("random")
