"""Per-adapter metric labels capped to the top K by requests, the rest summed under ``other``."""

from __future__ import annotations

import pytest

from services.runtime.capped_labels import OTHER, CappedLabels


def test_at_most_cap_names_keep_their_own_label():
    labels = CappedLabels(["a", "b"], {"a": 3}, cap=2)
    assert (labels("a"), labels("b")) == ("a", "b")  # b was never requested: still under the cap


def test_the_top_k_by_requests_are_named_and_the_rest_are_other():
    names = [f"adapter{i}" for i in range(10_000)]
    requests = {"adapter7": 50, "adapter9000": 40, "adapter3": 40, "adapter5": 1}
    labels = CappedLabels(names, requests, cap=3)
    assert {labels(n) for n in names} == {"adapter7", "adapter3", "adapter9000", OTHER}  # ties by name
    assert labels("adapter5") == OTHER
    assert labels.sum({"adapter7": 5, "adapter5": 2, "adapter1": 1}) == {"adapter7": 5, OTHER: 3}


def test_a_cap_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        CappedLabels(["a"], {}, cap=0)
