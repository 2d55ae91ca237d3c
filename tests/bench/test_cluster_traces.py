"""The issue-16 experiment's inputs: the popularity-shift trace and the capacity estimate."""

from __future__ import annotations

from collections import Counter

from bench.cluster_sim.cost_model import SHAPE_TERMS
from bench.cluster_sim.experiment import capacity_rps
from bench.cluster_sim.traces import shifted
from bench.cluster_sim.worker import WorkerSpec
from bench.workload import WorkloadSpec
from services.gpu_worker.engine.policies.linear_cost import LinearCost


def test_the_shift_trace_changes_which_adapters_are_hot_half_way():
    spec = WorkloadSpec(adapters=50, alpha=2.0, rate=20, cv=2, duration_s=40, seed=1)
    trace = shifted(spec)
    assert [r.time_s for r in trace] == sorted(r.time_s for r in trace)
    early = Counter(r.adapter for r in trace if r.time_s < 20)
    late = Counter(r.adapter for r in trace if r.time_s >= 20)
    assert early.most_common(1)[0][0] == 0  # the power law's head before the shift
    assert late.most_common(1)[0][0] != 0
    assert all(r.rank == spec.ranks[r.adapter % len(spec.ranks)] for r in trace)
    assert len({r.request_id for r in trace}) == len(trace)


def test_capacity_falls_as_steps_get_dearer():
    spec = WorkerSpec(max_running=32)
    cheap = capacity_rps(LinearCost.named(SHAPE_TERMS, base_ms=10, per_token_ms=0.5), spec)
    dear = capacity_rps(LinearCost.named(SHAPE_TERMS, base_ms=10, per_token_ms=1.0), spec)
    assert cheap > dear > 0
