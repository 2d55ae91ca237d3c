"""HRRN over hand-made engine snapshots: shortest predicted service first, ageing lifts the long."""

from __future__ import annotations

import pytest

from services.gpu_worker.engine.policies import make_batch_policy
from services.gpu_worker.engine.policies.batch_policy import (
    UNMERGED,
    BatchView,
    QueuedRequest,
    RunningRequest,
)
from services.gpu_worker.engine.policies.hrrn import Hrrn, HrrnConfig
from services.gpu_worker.engine.policies.linear_cost import LinearCost
from services.gpu_worker.engine.policies.step_cost_model import STEP_TERMS, step_cost_model

COST = LinearCost.named(STEP_TERMS, fixed=0.01)
"""Every step takes 10 ms: a request's service time is (1 + G′) steps."""


def hrrn() -> Hrrn:
    return Hrrn(HrrnConfig(default_output_tokens=100), step_cost_model(prior=COST))


def snapshot(now_s: float, *waiting: QueuedRequest) -> BatchView:
    return BatchView(
        now_s=now_s,
        waiting=waiting,
        running=(RunningRequest("r1", "a", 0.0),),
        max_running=8,
        mode=UNMERGED,
    )


def test_it_is_selectable_by_name():
    assert make_batch_policy("hrrn").name == "hrrn"


def test_equal_waits_put_the_shortest_prediction_first():
    view = snapshot(
        10.0,
        QueuedRequest("long", "a", 9.0, 8, predicted_output_tokens=399),
        QueuedRequest("short", "a", 9.0, 8, predicted_output_tokens=9),
        QueuedRequest("unknown", None, 9.0, 8),
    )
    policy = hrrn()
    assert policy.plan(view).run == ("r1", "short", "unknown", "long")
    assert policy.decisions() == {"reordered_steps": 1}


def test_a_long_request_that_waited_long_enough_overtakes_a_fresh_short_one():
    # long: S = 4 s, waited 12 s -> ratio 4; short: S = 0.1 s, waited 0.2 s -> ratio 3.
    long = QueuedRequest("long", "a", 0.0, 8, predicted_output_tokens=399)
    short = QueuedRequest("short", "a", 11.8, 8, predicted_output_tokens=9)
    assert hrrn().plan(snapshot(12.0, long, short)).run == ("r1", "long", "short")
    # Earlier, the long one had waited 2 s (ratio 1.5) and the short one 0.2 s (ratio 3).
    short_early = QueuedRequest("short", "a", 1.8, 8, predicted_output_tokens=9)
    assert hrrn().plan(snapshot(2.0, long, short_early)).run == ("r1", "short", "long")


def test_preempted_requests_go_first_whatever_their_ratio():
    view = snapshot(
        10.0,
        QueuedRequest("preempted", "a", 1.0, 50, started=True, predicted_output_tokens=1000),
        QueuedRequest("short", "a", 1.0, 8, predicted_output_tokens=1),
    )
    policy = hrrn()
    assert policy.plan(view).run == ("r1", "preempted", "short")
    assert policy.decisions() == {"reordered_steps": 0}


def test_response_ratio_is_wait_plus_service_over_service():
    request = QueuedRequest("q", "a", 6.0, 8, predicted_output_tokens=99)
    assert hrrn().response_ratio(request, now_s=10.0, decodes=2) == pytest.approx((4.0 + 1.0) / 1.0)


def test_a_default_length_below_one_is_refused():
    with pytest.raises(ValueError, match="default_output_tokens"):
        HrrnConfig(default_output_tokens=0)
