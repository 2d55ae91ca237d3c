"""S-LoRA early abort: the newest requests that can still meet the first-token SLO are served in
arrival order; older ones are aborted with the reason; started requests are never aborted."""

from __future__ import annotations

import pytest

from services.gpu_worker.engine.policies.batch_policy import (
    UNMERGED,
    BatchView,
    QueuedRequest,
    RunningRequest,
)
from services.gpu_worker.engine.policies.early_abort import EarlyAbort, EarlyAbortConfig
from services.gpu_worker.engine.policies.step_cost_model import StepCost, StepCostConfig, StepCostModel


def policy(slo_s: float) -> EarlyAbort:
    """Each first token costs exactly 1 s (a fixed cost model that never refits)."""
    cost = StepCostModel(StepCostConfig(min_steps=10**9), StepCost(1.0, 0.0, 0.0, 0.0))
    return EarlyAbort(EarlyAbortConfig(first_token_slo_s=slo_s), cost)


def queue(*arrivals: float, started: tuple[bool, ...] = ()) -> tuple[QueuedRequest, ...]:
    started = started or (False,) * len(arrivals)
    return tuple(QueuedRequest(f"q{i}", "a", t, 16, s) for i, (t, s) in enumerate(zip(arrivals, started)))


def plan(p: EarlyAbort, now: float, waiting, running=()):
    return p.plan(BatchView(now, waiting, tuple(running), 8, UNMERGED))


def test_nothing_is_aborted_while_every_request_can_make_its_slo():
    result = plan(policy(5.0), 10.0, queue(8.0, 8.5, 9.0))  # first tokens at 11, 12, 13
    assert result.aborts == () and result.run == ("q0", "q1", "q2")


def test_the_oldest_are_aborted_so_the_newer_ones_make_it():
    # SLO 4 s at t=10: q0 (arrived at 6) would get its token at 11, 5 s after arriving. Serving
    # q1..q3 gives tokens at 11, 12, 13 for arrivals 8, 9, 9.5: all within 4 s.
    result = plan(policy(4.0), 10.0, queue(6.0, 8.0, 9.0, 9.5))
    assert [a.request_id for a in result.aborts] == ["q0"]
    assert result.run == ("q1", "q2", "q3")
    assert "4 s SLO" in result.aborts[0].reason and "waited 4.00 s" in result.aborts[0].reason


def test_keeping_an_old_request_that_would_make_it_can_still_cost_it_its_place():
    # q0 alone would make it (token at 11, 3 s after arriving at 8), but q1 would then get its
    # token at 12, 3.5 s after arriving at 8.5. Without q0, q1's comes at 11: 2.5 s.
    result = plan(policy(3.0), 10.0, queue(8.0, 8.5))
    assert [a.request_id for a in result.aborts] == ["q0"]
    assert result.run == ("q1",)


def test_started_requests_go_first_never_aborted_and_their_recompute_counts():
    waiting = queue(0.0, 9.0, 9.5, started=(True, False, False))
    result = plan(policy(2.5), 10.0, waiting)  # q0 recomputes until 11; q1 at 12 (3 s): late
    assert [a.request_id for a in result.aborts] == ["q1"]
    assert result.run == ("q0", "q2")


def test_the_running_batch_always_keeps_stepping():
    result = plan(policy(1.0), 10.0, queue(0.0), running=[RunningRequest("r", "a", 0.0)])
    assert result.run == ("r",) and [a.request_id for a in result.aborts] == ["q0"]


def test_aborts_are_counted_and_the_slo_is_checked():
    p = policy(1.0)
    plan(p, 10.0, queue(0.0, 1.0))
    assert p.aborted == 2
    with pytest.raises(ValueError, match="first_token_slo_s must be > 0"):
        EarlyAbortConfig(first_token_slo_s=0)
