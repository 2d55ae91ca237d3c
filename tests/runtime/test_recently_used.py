"""The bounded most-recently-used mapping."""

from __future__ import annotations

import pytest

from services.runtime.recently_used import RecentlyUsed


def test_the_least_recently_used_key_leaves_first():
    kept: RecentlyUsed[str, int] = RecentlyUsed(2)
    assert kept.put("a", 1) == 1
    kept.put("b", 2)
    assert kept.get("a") == 1  # now b is the least recently used
    kept.put("c", 3)
    assert kept.keys() == ["a", "c"]
    assert kept.get("b") is None


def test_a_put_again_refreshes_a_key_and_drop_removes_what_it_is_told():
    kept: RecentlyUsed[tuple, str] = RecentlyUsed(3)
    for key in (("x", 1), ("y", 1), ("x", 2)):
        kept.put(key, str(key))
    kept.put(("x", 1), "again")
    assert kept.keys() == [("y", 1), ("x", 2), ("x", 1)]
    kept.drop(lambda key: key[0] == "x")
    assert kept.keys() == [("y", 1)]


def test_a_size_under_one_is_refused():
    with pytest.raises(ValueError, match="size must be at least 1"):
        RecentlyUsed(0)
