"""S-LoRA early abort: the newest requests that can still meet the first-token SLO are served in
arrival order; older ones are aborted with the reason; started requests are never aborted. The
first-token estimate replays the engine: prefills share a step within the prefill-token budget,
the running slots and the pool's room, and a full batch admits no one until a slot frees."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.gpu_worker.engine.policies.batch_policy import (
    UNMERGED,
    BatchView,
    QueuedRequest,
    RunningRequest,
)
from services.gpu_worker.engine.policies.early_abort import EarlyAbort, EarlyAbortConfig, first_token_times
from services.gpu_worker.engine.policies.linear_cost import FitConfig, LinearCost
from services.gpu_worker.engine.policies.step_cost_model import STEP_TERMS, step_cost_model

ONE_SECOND_A_STEP = LinearCost.named(STEP_TERMS, fixed=1.0)


def policy(slo_s: float, cost: LinearCost = ONE_SECOND_A_STEP) -> EarlyAbort:
    """A fixed cost model that never refits."""
    return EarlyAbort(
        EarlyAbortConfig(first_token_slo_s=slo_s), step_cost_model(FitConfig(min_rows=10**9), cost)
    )


def queue(*arrivals: float, started: tuple[bool, ...] = (), new_tokens: int = 4) -> tuple[QueuedRequest, ...]:
    """16-token prompts of adapter "a" that may generate ``new_tokens`` each."""
    started = started or (False,) * len(arrivals)
    return tuple(
        QueuedRequest(f"q{i}", "a", t, 16, s, max_new_tokens=new_tokens)
        for i, (t, s) in enumerate(zip(arrivals, started))
    )


def view(now, waiting, running=(), max_running=8, max_prefill_tokens=2048, kv_room_tokens=None) -> BatchView:
    return BatchView(
        now, tuple(waiting), tuple(running), max_running, UNMERGED, max_prefill_tokens, kv_room_tokens
    )


def aborted(p: EarlyAbort, v: BatchView) -> list[str]:
    return [a.request_id for a in p.plan(v).aborts]


def test_prefills_share_a_step_so_a_long_queue_can_all_make_it():
    # Four prompts fit in one step: all first tokens at 11, 3 s after arriving (charging each its
    # own step would put the last at 14 and abort the oldest).
    v = view(10.0, queue(8.0, 8.0, 8.0, 8.0))
    assert first_token_times(v, list(v.waiting), ONE_SECOND_A_STEP) == [11.0] * 4
    result = policy(3.0).plan(v)
    assert result.aborts == () and result.run == ("q0", "q1", "q2", "q3")


def test_the_prefill_token_budget_bounds_the_prompts_of_a_step():
    # 32 prompt tokens a step: two 16-token prompts per step, tokens at 11, 11, 12, 12, 13, 13.
    v = view(10.0, queue(6.0, 6.0, 8.0, 8.0, 9.0, 9.0), max_prefill_tokens=32)
    assert first_token_times(v, list(v.waiting), ONE_SECOND_A_STEP) == [11.0, 11.0, 12.0, 12.0, 13.0, 13.0]
    # SLO 3.5 s: q0, q1 (arrived at 6) cannot make it; without them q2..q5 get 11, 11, 12, 12.
    assert aborted(policy(3.5), v) == ["q0", "q1"]


def test_a_full_batch_admits_no_one_until_a_slot_frees():
    # Two slots, both running with 3 tokens to go: they step at 11, 12, 13 and the queue's first
    # tokens come at 14. q0 (arrived at 9) would wait 5 s, q1 (arrived at 10.5) 3.5 s.
    running = [RunningRequest(f"r{i}", "a", 0.0, remaining_tokens=3, context_tokens=20) for i in range(2)]
    v = view(10.0, queue(9.0, 10.5), running, max_running=2)
    assert first_token_times(v, list(v.waiting), ONE_SECOND_A_STEP) == [14.0, 14.0]
    result = policy(4.5).plan(v)
    assert [a.request_id for a in result.aborts] == ["q0"] and result.run == ("r0", "r1", "q1")
    # The same queue when the slots free after one step: tokens at 12, both within 4.5 s.
    soon = [RunningRequest(f"r{i}", "a", 0.0, remaining_tokens=1, context_tokens=20) for i in range(2)]
    assert aborted(policy(4.5), view(10.0, queue(9.0, 10.5), soon, max_running=2)) == []


def test_pool_room_holds_the_next_prompts_back_until_admitted_ones_end():
    # Each request needs 16 + 4 tokens of room; 40 tokens admit two at 11, which then decode at
    # 12, 13, 14 and give their room back: the next two get their first tokens at 15.
    v = view(10.0, queue(9.0, 9.0, 10.0, 10.0), kv_room_tokens=40)
    assert first_token_times(v, list(v.waiting), ONE_SECOND_A_STEP) == [11.0, 11.0, 15.0, 15.0]
    assert aborted(policy(4.0), v) == ["q0", "q1"]  # then q2, q3 get theirs at 11


def test_step_cost_follows_the_decodes_and_prefill_tokens_of_each_step():
    # 0.1 s a step + 0.01 s a prompt token + 0.5 s a decode: one running request decoding.
    cost = LinearCost(STEP_TERMS, (0.1, 0.01, 0.5, 0.0))
    running = [RunningRequest("r", "a", 0.0, remaining_tokens=9, context_tokens=20)]
    v = view(10.0, queue(9.0, 9.0), running, max_prefill_tokens=16)
    # Step 1: q0's 16 tokens + 1 decode = 0.1 + 0.16 + 0.5; step 2: q1's + 2 decodes.
    assert first_token_times(v, list(v.waiting), cost) == pytest.approx([10.76, 10.76 + 1.26])


def test_keeping_an_old_request_that_would_make_it_can_still_cost_it_its_place():
    # One slot: q0 alone would make it (token at 11, 3 s after arriving at 8), but then q1 would
    # get its token after q0's one-token output at 12, 3.5 s after arriving. Without q0: 11.
    result = policy(3.0).plan(view(10.0, queue(8.0, 8.5, new_tokens=1), max_running=1))
    assert [a.request_id for a in result.aborts] == ["q0"]
    assert result.run == ("q1",)
    assert "3 s SLO" in result.aborts[0].reason and "waited 2.00 s" in result.aborts[0].reason


def test_started_requests_go_first_never_aborted_and_their_recompute_counts():
    # The started q0 fills the first step's 32-token budget (recompute until 11); q1 and q2 come
    # at 12: q1 (arrived at 9) is 3 s late for a 2.5 s SLO, q2 (arrived at 9.5) makes it.
    recompute = QueuedRequest("q0", "a", 0.0, 32, started=True, max_new_tokens=4)
    waiting = (recompute, *(replace(r, request_id=f"q{i + 1}") for i, r in enumerate(queue(9.0, 9.5))))
    result = policy(2.5).plan(view(10.0, waiting, max_prefill_tokens=32))
    assert [a.request_id for a in result.aborts] == ["q1"]
    assert result.run == ("q0", "q2")


def test_the_running_batch_always_keeps_stepping():
    result = policy(1.0).plan(view(10.0, queue(0.0), [RunningRequest("r", "a", 0.0)]))
    assert result.run == ("r",) and [a.request_id for a in result.aborts] == ["q0"]


def test_aborts_are_counted_and_the_slo_is_checked():
    p = policy(1.0)
    p.plan(view(10.0, queue(0.0, 1.0)))
    assert p.aborted == 2 and p.decisions() == {"aborted": 2}
    with pytest.raises(ValueError, match="first_token_slo_s must be > 0"):
        EarlyAbortConfig(first_token_slo_s=0)


# -- per-request deadlines (the caller's first_token_deadline_ms, carried to the worker) --------


def deadlines(waiting: tuple[QueuedRequest, ...], *seconds: float | None) -> tuple[QueuedRequest, ...]:
    return tuple(replace(r, first_token_deadline_s=s) for r, s in zip(waiting, seconds))


def test_a_request_is_held_to_its_own_deadline_instead_of_the_workers_slo():
    # One prompt a step (16-token budget): tokens at 11, 12. Under the 10 s SLO both make it;
    # q1's own 0.5 s deadline (arrived at 10, token at 11 at best) does not, q0's own 30 s does.
    waiting = queue(9.0, 10.0)
    v = view(10.0, waiting, max_prefill_tokens=16)
    assert aborted(policy(10.0), v) == []
    tight = view(10.0, deadlines(waiting, 30.0, 0.5), max_prefill_tokens=16)
    result = policy(10.0).plan(tight)
    assert [a.request_id for a in result.aborts] == ["q1"] and result.run == ("q0",)
    reason = result.aborts[0].reason
    assert "first_token_deadline_ms of 500 ms" in reason and "even if served next" in reason


def test_a_longer_own_deadline_keeps_a_request_the_workers_slo_would_abort():
    # Tokens at 11, 12: q0 (arrived at 8) waits 3 s, q1 (arrived at 10) 2 s; the 2.5 s SLO aborts
    # q0, its own 5 s deadline keeps it.
    waiting = queue(8.0, 10.0)
    v = view(10.0, waiting, max_prefill_tokens=16)
    assert aborted(policy(2.5), v) == ["q0"]
    assert aborted(policy(2.5), view(10.0, deadlines(waiting, 5.0, None), max_prefill_tokens=16)) == []


def test_an_impossible_deadline_aborts_only_its_own_request():
    # q2's 0.5 s cannot be met even served first (a step takes 1 s). Left in the suffix search it
    # would have the older q0, q1 aborted for nothing; it goes alone and they run.
    waiting = deadlines(queue(9.0, 9.0, 10.0), None, None, 0.5)
    result = policy(5.0).plan(view(10.0, waiting, max_prefill_tokens=16))
    assert [a.request_id for a in result.aborts] == ["q2"] and result.run == ("q0", "q1")


def test_a_tight_but_feasible_newer_deadline_still_favours_the_newest_as_s_lora():
    # One slot, one token each: q0 at 11, q1 at 12. q1 (arrived at 10) asks for 1.5 s: only
    # without q0 does it make it (token at 11), so q0 is aborted, as under one SLO.
    waiting = deadlines(queue(9.0, 10.0, new_tokens=1), None, 1.5)
    result = policy(10.0).plan(view(10.0, waiting, max_running=1))
    assert [a.request_id for a in result.aborts] == ["q0"] and result.run == ("q1",)
    assert "the 10 s SLO" in result.aborts[0].reason


def test_the_replay_stops_at_a_requests_own_deadline():
    # Tokens would come at 11, 12, 13: q1's own 1 s (arrived at 10.5, token at 12) stops it there.
    v = view(10.0, deadlines(queue(10.0, 10.5, 10.5), None, 1.0, None), max_prefill_tokens=16)
    assert first_token_times(v, list(v.waiting), ONE_SECOND_A_STEP) == [11.0, 12.0, 13.0]
    assert first_token_times(v, list(v.waiting), ONE_SECOND_A_STEP, deadline_s=100.0) == [11.0]
