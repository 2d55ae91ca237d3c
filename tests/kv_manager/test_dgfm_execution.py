"""The order of a DGFM cycle's recalls (pure): from a pool with room when there is one, else
staged by the cycle's first worker."""

from __future__ import annotations

from services.kv_manager.dgfm import CycleSwap
from services.kv_manager.dgfm_execution import RecallStep, StepKind, cycle_steps

SWAP = CycleSwap(("a", "b", "c"), 4)


def steps(swap: CycleSwap, free: dict[str, int]) -> list[tuple[str, str, str]]:
    return [(s.kind.value, s.owner_id, s.holder_id) for s in cycle_steps(swap, free)]


def test_with_no_room_anywhere_the_first_worker_stages_around_the_others():
    assert steps(SWAP, {"a": 3, "b": 0, "c": 0}) == [
        ("stage_out", "a", "b"),
        ("recall", "b", "c"),
        ("recall", "c", "a"),
        ("stage_in", "a", "b"),
    ]
    assert all(s.blocks == 4 for s in cycle_steps(SWAP, {}))


def test_a_worker_with_room_starts_and_each_recall_uses_the_slots_the_previous_one_freed():
    assert steps(SWAP, {"a": 0, "b": 2, "c": 4}) == [
        ("recall", "c", "a"),
        ("recall", "a", "b"),
        ("recall", "b", "c"),
    ]
    # The first worker in cycle order with room starts, whoever has the most.
    assert steps(SWAP, {"a": 0, "b": 4, "c": 100}) == [
        ("recall", "b", "c"),
        ("recall", "c", "a"),
        ("recall", "a", "b"),
    ]


def test_every_recall_of_the_swap_is_made_once_and_a_two_cycle_too():
    for free in ({}, {"b": 9}):
        made = {(s.owner_id, s.holder_id) for s in cycle_steps(SWAP, free) if s.kind is not StepKind.STAGE_IN}
        assert made == {(r.owner_id, r.holder_id) for r in SWAP.recalls}
    assert cycle_steps(CycleSwap(("x", "y"), 1), {}) == (
        RecallStep(StepKind.STAGE_OUT, "x", "y", 1),
        RecallStep(StepKind.RECALL, "y", "x", 1),
        RecallStep(StepKind.STAGE_IN, "x", "y", 1),
    )
