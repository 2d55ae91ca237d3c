"""A run's figures from its requests' outcomes."""

from __future__ import annotations

import pytest

from bench.distkv.outcome import RequestOutcome, summarize


def done(request_id: str, prompt: int, tokens: list[float], long: bool = False, started: float = 0.0):
    return RequestOutcome(request_id, 0, prompt, long, output_tokens=len(tokens), started_s=started,
                          first_token_s=tokens[0], finished_s=tokens[-1], token_times_s=tokens)  # fmt: skip


def test_decode_step_is_the_mean_gap_between_tokens():
    assert done("a", 10, [1.0, 1.5, 2.5]).decode_step_s == pytest.approx(0.75)
    assert done("b", 10, [1.0]).decode_step_s is None


def test_summary_counts_statuses_tokens_and_latencies():
    outcomes = [
        done("s1", 100, [1.0, 2.0]),
        done("s2", 200, [2.0, 4.0], started=1.0),
        done("l1", 1200, [5.0, 7.0, 9.0], long=True),
        RequestOutcome("l2", 1, 1300, True, status="refused", detail="RESOURCE_EXHAUSTED: too long"),
        RequestOutcome("s3", 2, 150, False, status="stuck"),
    ]
    summary = summarize(outcomes, wall_s=10.0)
    assert (summary["requests"], summary["long_requests"]) == (5, 2)
    assert (summary["completed"], summary["refused"], summary["stuck"], summary["failed"]) == (3, 1, 1, 0)
    assert (summary["long_completed"], summary["long_refused"]) == (1, 1)
    assert summary["output_tokens"] == 7
    assert summary["output_tokens_per_s"] == pytest.approx(0.7)
    assert summary["served_tokens_per_s"] == pytest.approx((100 + 200 + 1200 + 7) / 10)
    assert summary["short_latency_s"]["max"] == pytest.approx(3.0)
    assert summary["long_latency_s"]["p50"] == pytest.approx(9.0)
    assert summary["mean_decode_step_ms"] == pytest.approx(1000 * (1.0 + 2.0 + 2.0) / 3, abs=0.01)


def test_a_run_with_nothing_completed_has_no_latencies():
    summary = summarize([RequestOutcome("x", 0, 10, False, status="failed")], wall_s=1.0)
    assert summary["completed"] == 0 and summary["output_tokens_per_s"] == 0
    assert summary["latency_s"] == {"p50": None, "p90": None, "max": None}
    assert summary["mean_decode_step_ms"] is None
