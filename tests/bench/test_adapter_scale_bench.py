"""The adapters-at-scale benches (issue 30): their traces offer the same requests whatever the
number of adapters, and their quick logic runs end to end on a tiny model (no timing verdict)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.adapter_scale_bench import (
    CLIFF_QUICK,
    SCALE_QUICK,
    CliffBench,
    EngineSetting,
    ScaleBench,
    equal_load_traces,
    first_token_p50,
    markdown,
    offered,
    run_cliff,
    run_scale,
)
from bench.systems.base import RequestRecord
from bench.workload import WorkloadSpec, generate, generate_shared_arrivals


def test_quick_traces_offer_identical_arrivals_and_lengths():
    traces = equal_load_traces(SCALE_QUICK.workload, SCALE_QUICK.counts)
    small, large = traces[100], traces[10_000]
    assert offered(small) == offered(large) and len(small) > 50
    assert max(r.adapter for r in small) < 100 and max(r.adapter for r in large) >= 100
    assert len({r.adapter for r in large}) > len({r.adapter for r in small})
    # The cliff's two cases: the same requests, uniform over 8 or 16 adapters.
    fit, twice = equal_load_traces(CLIFF_QUICK.workload, (8, 16)).values()
    assert offered(fit) == offered(twice)
    assert {r.adapter for r in fit} == set(range(8)) and {r.adapter for r in twice} == set(range(16))
    # S-LoRA's per-adapter processes do not: what the old n-sweep compared.
    assert len(generate(replace(SCALE_QUICK.workload, adapters=100))) != len(
        generate(replace(SCALE_QUICK.workload, adapters=2000))
    )


def test_shared_arrivals_follow_the_power_law_and_the_total_rate():
    spec = WorkloadSpec(adapters=10, alpha=1.0, rate=50.0, duration_s=200.0, seed=3)
    trace = generate_shared_arrivals(spec)
    assert len(trace) == pytest.approx(spec.rate * spec.duration_s, rel=0.05)
    counts = [sum(r.adapter == i for r in trace) for i in range(spec.adapters)]
    assert counts[0] / counts[1] == pytest.approx(2.0, rel=0.15) and counts[0] > counts[9]
    assert generate_shared_arrivals(spec) == trace


def test_p50_first_token_counts_requests_without_one_as_late():
    def record(first: float | None) -> RequestRecord:
        return RequestRecord("r", 0, 1.0, 4, 4, first_token_s=first)

    assert first_token_p50([record(1.5), record(2.0), record(None)]) == 1.0
    assert first_token_p50([record(1.5), record(None), record(None)]) is None


def test_quick_logic_runs_both_benches_on_a_tiny_model(model_dir, one_thread, tmp_path):
    tiny = replace(SCALE_QUICK.workload, rate=20.0, duration_s=0.4, input_range=(4, 12), output_range=(2, 5))
    engine = EngineSetting(pool_mib=1, host_cache_mib=0.02, max_batch=4, drain_s=60.0)
    scale = run_scale(
        ScaleBench(workload=tiny, counts=(4, 10_000), rounds=1, engine=engine),
        str(model_dir),
        tmp_path,
        log=lambda line: None,
    )
    runs = {r["n"]: r for r in scale["runs"]}
    assert runs[4]["requests"] == runs[10_000]["requests"] > 0
    assert all(r["metrics"]["completed"] == r["requests"] for r in runs.values())
    assert runs[10_000]["distinct_adapters"] > runs[4]["distinct_adapters"]
    assert scale["summary"]["10000"]["tok_s_ratio"] is not None and "| n=4 |" in markdown(scale)

    cliff = run_cliff(
        CliffBench(workload=replace(tiny, alpha=0.0), slots=2, rates=(20.0,), rounds=1, engine=engine),
        str(model_dir),
        tmp_path,
        log=lambda line: None,
    )
    assert cliff["slot_region"]["slots_checked"] == 2
    by_case = {r["case"]: r for r in cliff["runs"]}
    assert by_case["fit"]["requests"] == by_case["2x"]["requests"]
    assert all(r["metrics"]["completed"] == r["requests"] for r in cliff["runs"])
    assert all(r["max_resident_adapters"] <= 2 for r in cliff["runs"])
    assert cliff["summary"]["20"]["2x / fit"]["p50_first_token_ratio"] is not None
