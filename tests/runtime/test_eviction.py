"""The eviction interface: LRU, LFU and FIFO order cached keys, pins keep keys out of the victims
whatever the order, and the cache says which may go."""

from __future__ import annotations

import pytest

from services.runtime.eviction import (
    FIFOEviction,
    LFUEviction,
    LRUEviction,
    make_eviction_policy,
    set_pins,
)

POLICIES = [LRUEviction, LFUEviction, FIFOEviction]


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


def test_lfu_evicts_the_least_frequently_used_first_and_ties_least_recently_used():
    policy = LFUEviction()
    for key in ("a", "b", "c", "d", "a", "a", "c", "b"):
        policy.touch(key)
    # counts: a 3, b 2, c 2, d 1; among b and c (2 each), c was touched before b last
    assert list(policy.victims("abcd")) == ["d", "c", "b", "a"]
    assert policy.order() == ["d", "c", "b", "a"]


def test_lfu_forgets_a_removed_keys_count():
    policy = LFUEviction()
    for key in ("a", "a", "a", "b", "b"):
        policy.touch(key)
    policy.remove("a")
    policy.touch("a")  # back with a count of 1
    assert policy.order() == ["a", "b"]


def test_lfu_walks_lazily_over_many_keys():
    policy = LFUEviction()
    keys = range(10_000)
    for key in keys:
        policy.touch(key)
    for key in range(0, 10_000, 2):
        policy.touch(key)  # the even keys are used twice
    victims = policy.victims(keys)
    assert [next(victims) for _ in range(3)] == [1, 3, 5]
    assert policy.order()[4_999:5_001] == [9_999, 0]


@pytest.mark.parametrize("make", POLICIES)
def test_only_candidates_are_victims_and_removed_keys_are_forgotten(make):
    policy = make()
    for key in ("a", "b", "c"):
        policy.touch(key)
    policy.remove("b")
    policy.remove("unknown")  # ignored
    assert list(policy.victims(["c", "b"])) == ["c"]
    assert policy.order() == ["a", "c"]


@pytest.mark.parametrize("make", POLICIES)
def test_the_cache_may_evict_while_it_walks_the_victims(make):
    policy = make()
    for key in range(4):
        policy.touch(key)
    walked = []
    for key in policy.victims(range(4)):
        policy.remove(key)
        walked.append(key)
        if len(walked) == 2:
            break
    assert walked == [0, 1] and policy.order() == [2, 3]


def test_lfu_walk_goes_on_past_buckets_emptied_under_it():
    policy = LFUEviction()
    for key in ("a", "b", "c", "c", "d", "d", "d"):
        policy.touch(key)  # buckets 1: a b, 2: c, 3: d
    walked = []
    for key in policy.victims("abcd"):
        walked.append(key)
        policy.remove(key)  # empties (and unlinks) each bucket in turn
    assert walked == ["a", "b", "c", "d"] and policy.order() == []


@pytest.mark.parametrize("make", POLICIES)
def test_pinned_keys_are_never_victims_whatever_the_order(make):
    policy = make()
    policy.pin("b")  # before the cache holds it
    for key in ("a", "b", "c"):
        policy.touch(key)
    policy.pin("a")
    assert list(policy.victims("abc")) == ["c"]
    assert policy.order() == ["a", "b", "c"]  # pinned keys keep their place in the order
    policy.remove("b")
    policy.touch("b")
    assert list(policy.victims("abc")) == ["c"]  # a pin outlives the key's stay in the cache
    policy.unpin("a")
    policy.unpin("unknown")  # ignored
    assert list(policy.victims("abc")) == ["a", "c"] and policy.pinned() == {"b"}


def test_set_pins_makes_the_given_keys_the_pinned_set():
    policy = LRUEviction()
    policy.pin("a")
    policy.pin("b")
    set_pins(policy, ["b", "c"])
    assert policy.pinned() == {"b", "c"}


def test_policies_are_made_by_name():
    assert isinstance(make_eviction_policy("lru"), LRUEviction)
    assert isinstance(make_eviction_policy("lfu"), LFUEviction)
    assert isinstance(make_eviction_policy("fifo"), FIFOEviction)
    with pytest.raises(ValueError, match="known: fifo, lfu, lru"):
        make_eviction_policy("random")
