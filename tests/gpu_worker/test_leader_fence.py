"""The worker's memory of the kv_manager leader's term (pure): a newer term replaces it, an older
one, none, or another kv_manager's claim on it is refused, with one line naming both terms."""

from __future__ import annotations

import pytest

from services.gpu_worker.leader_fence import LeaderFence
from services.runtime.errors import FailedPrecondition, InvalidArgument, StaleLeaderTerm


def test_the_newest_term_is_taken_and_an_older_one_refused_naming_both():
    fence = LeaderFence()
    fence.admit(7, "kv-a", "RecallBlocks")
    assert (fence.term, fence.leader, fence.accepted) == (7, "kv-a", 1)
    fence.admit(9, "kv-b", "StageOutBlocks")  # a newer leader replaces it at once
    fence.admit(9, "kv-b", "StageInBlocks")
    assert (fence.term, fence.leader, fence.accepted) == (9, "kv-b", 3)

    with pytest.raises(StaleLeaderTerm) as refused:
        fence.admit(7, "kv-a", "RecallBlocks")
    assert refused.value.current_term == 9
    assert refused.value.message == (
        "RecallBlocks from kv_manager kv-a under term 7 refused: this worker has taken term 9 "
        "(kv_manager kv-b); kv-a is not the leader"
    )
    assert (fence.term, fence.leader, fence.accepted, fence.refused) == (9, "kv-b", 3, 1)


def test_a_write_without_a_term_is_refused_even_before_any_leader_wrote():
    fence = LeaderFence()
    with pytest.raises(StaleLeaderTerm, match="without a leader term") as refused:
        fence.admit(0, "", "RecallBlocks")
    assert refused.value.current_term == 0 and fence.refused == 1
    fence.admit(3, "kv-a", "RecallBlocks")
    with pytest.raises(StaleLeaderTerm, match="has taken term 3"):
        fence.admit(0, "kv-a", "StageInBlocks")


def test_a_term_is_one_kv_managers_and_a_term_names_its_kv_manager():
    fence = LeaderFence()
    fence.admit(5, "kv-a", "RecallBlocks")
    with pytest.raises(FailedPrecondition, match="term 5 is kv_manager kv-a's") as refused:
        fence.admit(5, "kv-b", "RecallBlocks")
    assert not isinstance(refused.value, StaleLeaderTerm)  # kv-b's own term may be newer elsewhere
    with pytest.raises(InvalidArgument, match="names no leader"):
        fence.admit(6, "", "RecallBlocks")
    assert (fence.term, fence.leader, fence.accepted, fence.refused) == (5, "kv-a", 1, 1)
