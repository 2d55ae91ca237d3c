"""Serving metrics from request records (bench.serving.metrics)."""

from __future__ import annotations

import pytest

from bench.serving.metrics import summarize
from bench.systems.base import RequestRecord


def record(i: int, arrival: float, first: float | None, finish: float | None, out: int = 10) -> RequestRecord:
    return RequestRecord(f"r{i}", 0, arrival, 8, out, first, finish, out if finish is not None else 3)


def test_throughput_latency_slo_and_satisfaction():
    records = [
        record(0, 0.0, 1.0, 2.0),  # first token after 1 s
        record(1, 1.0, 4.0, 6.0),  # after 3 s
        record(2, 2.0, 9.0, None),  # after 7 s: misses a 6 s SLO, never completes
        record(3, 3.0, None, None),  # nothing at all
    ]
    m = summarize(records, window_s=20.0, slo_s=6.0)
    assert (m.requests, m.completed) == (4, 2)
    assert m.duration_s == 20.0  # some were cut by the window: the whole window counts
    # Tokens of unfinished requests (3 each) count: they are work done within the window.
    assert m.throughput_rps == pytest.approx(2 / 20) and m.throughput_tps == pytest.approx(26 / 20)
    assert m.avg_latency_s == pytest.approx((2 + 5) / 2)
    assert m.avg_first_token_s == pytest.approx((1 + 3 + 7) / 3)
    assert m.slo_attainment == pytest.approx(2 / 4)  # requests without a first token count as misses
    assert m.user_satisfaction == pytest.approx(((1 - 1 / 6) + (1 - 3 / 6) + 0 + 0) / 4)


def test_a_run_that_keeps_up_is_measured_until_its_last_completion():
    m = summarize([record(0, 0.0, 1.0, 2.0), record(1, 0.5, 3.0, 4.0)], window_s=10.0, slo_s=6.0)
    assert m.duration_s == 4.0 and m.throughput_rps == pytest.approx(0.5)
    m = summarize([record(1, 0.5, 3.0, None)], window_s=10.0, slo_s=6.0)
    assert m.duration_s == 10.0 and m.throughput_rps == 0.0 and m.avg_latency_s is None


def test_an_errored_request_is_not_completed():
    failed = record(0, 0.0, 1.0, 2.0)
    failed.error = "engine error"
    assert summarize([failed], 10.0, 6.0).completed == 0
