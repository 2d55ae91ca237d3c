"""DGFM: debt cycles found and cancelled by the smallest edge, only above the swap threshold;
no debt ever grows, occupancy never changes, and no cycle worth swapping is left."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.kv_manager.dgfm import BlockRecall, CycleSwap, DgfmConfig, _find_cycle, plan_defragmentation


def test_a_three_cycle_shrinks_by_its_smallest_debt():
    debts = {("a", "b"): 10, ("b", "c"): 6, ("c", "a"): 8, ("a", "c"): 3}
    plan = plan_defragmentation(debts, DgfmConfig(min_swap_blocks=4))
    assert plan.swaps == (CycleSwap(("a", "b", "c"), 6),)
    assert plan.swap_count == 1 and plan.blocks_moved == 18
    assert dict(plan.debts_after) == {("a", "b"): 4, ("c", "a"): 2, ("a", "c"): 3}
    assert plan.remote_blocks_before == 27 and plan.remote_blocks_after == 9
    assert plan.frozen_workers == {"a", "b", "c"}
    assert plan.swaps[0].recalls == (
        BlockRecall("a", "b", 6), BlockRecall("b", "c", 6), BlockRecall("c", "a", 6),
    )  # fmt: skip


def test_cycles_below_the_threshold_are_left_alone():
    debts = {("a", "b"): 10, ("b", "c"): 3, ("c", "a"): 8}
    plan = plan_defragmentation(debts, DgfmConfig(min_swap_blocks=4))
    assert plan.swap_count == 0 and dict(plan.debts_after) == debts


def test_two_cycles_sharing_a_node_are_both_cancelled():
    debts = {("a", "b"): 5, ("b", "a"): 5, ("a", "c"): 7, ("c", "a"): 4}
    plan = plan_defragmentation(debts, DgfmConfig(min_swap_blocks=1))
    assert sorted(plan.swaps, key=lambda s: s.cycle) == [CycleSwap(("a", "b"), 5), CycleSwap(("a", "c"), 4)]
    assert dict(plan.debts_after) == {("a", "c"): 3}


def test_no_cycle_no_swap():
    plan = plan_defragmentation({("a", "b"): 9, ("b", "c"): 9})
    assert plan.swaps == () and plan.blocks_moved == 0


def test_threshold_must_be_positive():
    with pytest.raises(ValueError, match="min_swap_blocks"):
        DgfmConfig(min_swap_blocks=0)


debt_graphs = st.dictionaries(
    st.tuples(st.sampled_from("abcdef"), st.sampled_from("abcdef")).filter(lambda e: e[0] != e[1]),
    st.integers(1, 30),
    max_size=20,
)


def net_position(debts, worker):
    """Blocks held for others minus blocks held by others: what a swap must not change."""
    return sum(n for (d, c), n in debts.items() if c == worker) - sum(
        n for (d, c), n in debts.items() if d == worker
    )


@settings(max_examples=300, deadline=None)
@given(debt_graphs, st.integers(1, 10), st.integers(0, 2**32 - 1))
def test_dgfm_never_grows_a_debt_and_leaves_no_cycle_worth_swapping(debts, threshold, seed):
    plan = plan_defragmentation(debts, DgfmConfig(min_swap_blocks=threshold), random.Random(seed))
    after = plan.debts_after
    assert all(0 < n <= debts[edge] for edge, n in after.items())
    assert set(after) <= set(debts)
    for worker in "abcdef":
        assert net_position(after, worker) == net_position(debts, worker)
    for swap in plan.swaps:
        assert swap.blocks >= threshold and len(set(swap.cycle)) == len(swap.cycle) >= 2
    assert plan.remote_blocks_before - plan.remote_blocks_after == plan.blocks_moved
    if plan.swaps:
        assert plan.remote_blocks_after < plan.remote_blocks_before
    heavy = {}
    for (d, c), n in after.items():
        if n >= threshold:
            heavy.setdefault(d, {})[c] = n
    assert _find_cycle(heavy, sorted(heavy)) is None


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from("abcdefgh"), min_size=2, max_size=8, unique=True),
    st.lists(st.integers(4, 50), min_size=8, max_size=8),
)
def test_any_cycle_above_the_threshold_strictly_reduces_every_debt_on_it(cycle, weights):
    debts = {(cycle[i], cycle[(i + 1) % len(cycle)]): weights[i] for i in range(len(cycle))}
    plan = plan_defragmentation(debts, DgfmConfig(min_swap_blocks=4))
    assert plan.swap_count == 1
    m = min(debts.values())
    assert all(plan.debts_after.get(edge, 0) == n - m for edge, n in debts.items())
