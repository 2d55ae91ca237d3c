"""The synthetic trace has the statistics S-LoRA's method specifies, and replays round-trip."""

from __future__ import annotations

import numpy as np
import pytest

from bench.workload import WorkloadSpec, adapter_rates, generate, read_jsonl, write_jsonl

SPEC = WorkloadSpec(adapters=20, alpha=1.0, rate=20.0, cv=2.0, duration_s=600.0, seed=7)


def test_total_rate_and_duration():
    trace = generate(SPEC)
    assert len(trace) == pytest.approx(SPEC.rate * SPEC.duration_s, rel=0.1)
    times = [r.time_s for r in trace]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < SPEC.duration_s


def test_popularity_follows_the_power_law():
    rates = adapter_rates(SPEC)
    assert rates.sum() == pytest.approx(SPEC.rate) and np.all(np.diff(rates) < 0)
    assert rates[0] / rates[1] == pytest.approx(2.0)  # i^-1: the first is twice the second
    counts = np.bincount([r.adapter for r in generate(SPEC)], minlength=SPEC.adapters)
    assert counts[0] == pytest.approx(rates[0] * SPEC.duration_s, rel=0.15)
    assert counts[0] > counts[5] > counts[19]


def test_each_adapters_gaps_have_the_requested_cv():
    busiest = np.array([r.time_s for r in generate(SPEC) if r.adapter == 0])
    gaps = np.diff(busiest)
    assert gaps.std() / gaps.mean() == pytest.approx(SPEC.cv, rel=0.15)
    poisson = np.diff(
        [r.time_s for r in generate(WorkloadSpec(**{**SPEC.__dict__, "cv": 1.0})) if r.adapter == 0]
    )
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.15)


def test_lengths_ranks_and_determinism(tmp_path):
    trace = generate(SPEC)
    assert all(SPEC.input_range[0] <= r.input_len <= SPEC.input_range[1] for r in trace)
    assert all(SPEC.output_range[0] <= r.output_len <= SPEC.output_range[1] for r in trace)
    assert all(r.rank == SPEC.ranks[r.adapter % len(SPEC.ranks)] for r in trace)
    assert generate(SPEC) == trace and generate(WorkloadSpec(**{**SPEC.__dict__, "seed": 8})) != trace
    path = tmp_path / "trace.jsonl"
    write_jsonl(trace, path)
    assert read_jsonl(path) == trace


def test_bad_trace_lines_are_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"time_s": 1.0, "adapter": 0, "input_len": 5, "output_len": 3}\n{"time_s": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_jsonl(path)


def test_bursty_short_traces_start_in_steady_state():
    # Started at t=0, a cv=4 process front-loads every adapter's first arrivals: the count of a
    # short trace was ~10x R*D. In steady state it averages R*D.
    counts = [
        len(generate(WorkloadSpec(adapters=100, rate=2, cv=4, duration_s=20, seed=s))) for s in range(20)
    ]
    assert 30 <= sum(counts) / len(counts) <= 50
