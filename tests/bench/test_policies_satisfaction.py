"""S-LoRA's first-token scores and Jain's index, on hand-made records."""

from __future__ import annotations

import pytest

from bench.policies.satisfaction import first_token_scores, jain_index, per_adapter_mean_latency
from bench.systems.base import RequestRecord


def record(
    arrival: float, first: float | None, adapter: int = 0, finish: float | None = None, error: str = ""
):
    r = RequestRecord(f"r{arrival}-{first}", adapter, arrival, 4, 2, first_token_s=first, finish_s=finish)
    r.error = error
    return r


def test_linear_and_quadratic_satisfaction_and_attainment():
    records = [
        record(0.0, 0.0),  # t = 0: scores 1 and 1
        record(1.0, 2.0),  # t = 1 = SLO/2: 0.5 and 0.75
        record(0.0, 2.0),  # t = SLO: met, scores 0 and 0
        record(0.0, 3.0),  # missed: 0
        record(0.0, None, error="aborted"),  # no token: 0
    ]
    scores = first_token_scores(records, slo_s=2.0)
    assert scores.attainment == pytest.approx(3 / 5)
    assert scores.linear_satisfaction == pytest.approx((1 + 0.5 + 0) / 5)
    assert scores.quadratic_satisfaction == pytest.approx((1 + 0.75 + 0) / 5)
    assert scores.aborted == 1


def test_quadratic_form_is_never_below_the_linear_one():
    records = [record(0.0, t / 10) for t in range(25)]
    scores = first_token_scores(records, slo_s=1.7)
    assert scores.quadratic_satisfaction >= scores.linear_satisfaction


def test_scores_need_a_positive_slo():
    with pytest.raises(ValueError, match="slo_s"):
        first_token_scores([record(0.0, 1.0)], slo_s=0)


def test_jain_index_bounds():
    assert jain_index([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert jain_index([5.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain_index([1.0, 3.0]) == pytest.approx(16 / 20)
    assert jain_index([]) == 1.0


def test_per_adapter_mean_latency_counts_completed_requests_only():
    records = [
        record(0.0, 0.5, adapter=1, finish=2.0),
        record(1.0, 1.5, adapter=1, finish=5.0),
        record(0.0, 0.5, adapter=0, finish=1.0),
        record(0.0, 0.5, adapter=2),  # cut by the window
    ]
    assert per_adapter_mean_latency(records) == {0: 1.0, 1: 3.0}
