"""The batch-policy suite's traces: deterministic, the asked skew, the asked lengths."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from bench.policies.traces import RANK, backlog_trace, prefill_queue, skewed_trace, zipf_gamma_trace


def test_skewed_trace_gives_the_top_adapter_its_share():
    trace = skewed_trace(8, 0.7, rate=200.0, duration_s=20.0, input_range=(4, 9), output_range=(3, 5), seed=1)
    counts = Counter(r.adapter for r in trace)
    assert counts[0] / len(trace) == pytest.approx(0.7, abs=0.02)
    others = [counts[a] / len(trace) for a in range(1, 8)]
    assert max(others) - min(others) < 0.02
    assert all(4 <= r.input_len <= 9 and 3 <= r.output_len <= 5 and r.rank == RANK for r in trace)
    times = [r.time_s for r in trace]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 20.0
    assert len(trace) == pytest.approx(200 * 20, rel=0.05)


def test_skewed_trace_is_uniform_at_one_over_n_and_deterministic():
    trace = skewed_trace(
        8, 1 / 8, rate=200.0, duration_s=20.0, input_range=(4, 4), output_range=(3, 3), seed=2
    )
    shares = np.bincount([r.adapter for r in trace], minlength=8) / len(trace)
    assert np.allclose(shares, 1 / 8, atol=0.02)
    again = skewed_trace(
        8, 1 / 8, rate=200.0, duration_s=20.0, input_range=(4, 4), output_range=(3, 3), seed=2
    )
    assert trace == again
    assert len({r.request_id for r in trace}) == len(trace)


@pytest.mark.parametrize("share", [0.05, 1.5])
def test_skewed_trace_rejects_a_share_outside_uniform_to_all(share):
    with pytest.raises(ValueError, match="top_share"):
        skewed_trace(8, share, rate=1.0, duration_s=1.0, input_range=(1, 1), output_range=(1, 1), seed=0)


def test_prefill_queue_is_all_at_zero_one_token_out_round_robin_tasks():
    queue = prefill_queue(tasks=32, prompts=4000, mean_len=32, sigma=8.0, seed=3)
    assert all(r.time_s == 0.0 and r.output_len == 1 for r in queue)
    assert [r.adapter for r in queue[:33]] == [*range(32), 0]
    lengths = np.array([r.input_len for r in queue])
    assert lengths.mean() == pytest.approx(32, abs=0.5)
    assert lengths.std() == pytest.approx(8, abs=0.5)
    assert lengths.min() >= 1


def test_prefill_queue_with_no_spread_has_one_length():
    assert {r.input_len for r in prefill_queue(tasks=4, prompts=50, mean_len=20, sigma=0.0, seed=0)} == {20}


def test_backlog_and_zipf_traces_use_rank_8_adapters():
    backlog = backlog_trace(adapters=3, requests=7, input_range=(5, 5), output_range=(2, 2), seed=0)
    assert [r.adapter for r in backlog] == [0, 1, 2, 0, 1, 2, 0] and {r.time_s for r in backlog} == {0.0}
    zipf = zipf_gamma_trace(32, 1.0, rate=20.0, cv=2.0, duration_s=30.0, input_range=(4, 8),
                            output_range=(4, 8), seed=0)  # fmt: skip
    counts = Counter(r.adapter for r in zipf)
    assert {r.rank for r in zipf} == {RANK}
    assert counts[0] > counts[31]
