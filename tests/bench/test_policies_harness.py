"""Run sizing of the batch-policy suite: traces in requests, windows that let a keeping-up
system finish."""

from __future__ import annotations

import pytest

from bench.policies.capacity import backlog_throughput
from bench.policies.harness import trace_seconds, window_s
from bench.systems.base import RequestRecord


def test_trace_lasts_the_requests_over_the_rate_and_the_window_adds_the_backlog():
    assert trace_seconds(24, rate=2.0) == 12.0
    # 24 requests at 2/s over 12 s; as one backlog at 3/s they take 8 s more; plus a 5 s drain.
    assert window_s(24, rate=2.0, capacity_rps=3.0, drain_s=5.0) == pytest.approx(25.0)


def test_backlog_throughput_counts_completed_requests_over_the_last_completion():
    records = [
        RequestRecord(f"r{i}", 0, 0.0, 4, 2, first_token_s=0.1, finish_s=f)
        for i, f in enumerate((1.0, 2.0, 4.0))
    ]
    records.append(RequestRecord("cut", 0, 0.0, 4, 2))
    assert backlog_throughput(records) == pytest.approx(3 / 4.0)
    with pytest.raises(RuntimeError, match="no request"):
        backlog_throughput([RequestRecord("cut", 0, 0.0, 4, 2)])
