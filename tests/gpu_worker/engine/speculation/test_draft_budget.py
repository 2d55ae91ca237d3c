"""Each request's k follows its acceptance; drafts that keep failing pause it, with back-off."""

from __future__ import annotations

import pytest

from services.gpu_worker.engine.speculation.draft_budget import DraftBudget, DraftSettings
from services.gpu_worker.engine.speculation.request_drafter import RequestDrafter

SETTINGS = DraftSettings(max_draft_tokens=4, stop_after_misses=2, backoff_steps=2, max_backoff_steps=4)


def test_k_shrinks_to_one_past_the_accepted_prefix_and_grows_on_full_acceptance():
    budget = DraftBudget(SETTINGS)
    assert budget.allowed() == 4
    budget.verified(4, 1)
    assert budget.allowed() == 2
    budget.verified(2, 2)
    assert budget.allowed() == 3
    budget.verified(1, 1)  # a short draft accepted whole keeps k
    assert budget.allowed() == 3


def test_misses_in_a_row_pause_drafting_with_a_doubling_back_off():
    budget = DraftBudget(SETTINGS)
    budget.verified(4, 0)
    assert budget.allowed() == 1  # one miss: k falls, drafting goes on
    budget.verified(1, 0)
    assert [budget.allowed() for _ in range(3)] == [0, 0, 1]  # paused 2 steps
    budget.verified(1, 0)
    budget.verified(1, 0)
    assert [budget.allowed() for _ in range(5)] == [0, 0, 0, 0, 1]  # paused 4 steps
    budget.verified(1, 0)
    budget.verified(1, 0)
    assert [budget.allowed() for _ in range(5)] == [0, 0, 0, 0, 1]  # capped at 4


def test_an_accepted_draft_resets_the_back_off():
    budget = DraftBudget(SETTINGS)
    for _ in range(2):
        budget.verified(1, 0)
    budget.verified(1, 0)  # the miss streak restarted after the pause
    assert budget.misses == 1 and budget.backoff == 4
    budget.verified(1, 1)
    assert budget.misses == 0 and budget.backoff == 2


def test_the_drafter_drafts_within_its_limit_and_budget():
    drafter = RequestDrafter(SETTINGS)
    sequence = [1, 2, 3, 4, 5, 6, 1, 2]
    assert drafter.propose(sequence, limit=10) == (3, 4, 5, 6)
    assert drafter.propose(sequence, limit=2) == (3, 4)
    assert drafter.propose(sequence, limit=0) == ()


def test_settings_are_checked():
    with pytest.raises(ValueError, match="backoff_steps"):
        DraftSettings(backoff_steps=0)
    with pytest.raises(ValueError, match="max_draft_tokens"):
        DraftSettings(max_draft_tokens=0)


def test_a_declined_request_probes_with_a_doubling_wait_until_accepted():
    budget = DraftBudget(SETTINGS)
    assert [budget.declined() for _ in range(2)] == [False, True]  # after 2 declined steps
    assert [budget.declined() for _ in range(4)] == [False, False, False, True]  # then 4
    assert [budget.declined() for _ in range(4)] == [False, False, False, True]  # capped at 4
    budget.verified(1, 1)
    assert budget.backoff == 2
