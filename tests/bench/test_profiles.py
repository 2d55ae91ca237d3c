"""The benchmark profiles: every sweep the issue asks for, each (system, workload) run once."""

from __future__ import annotations

from bench.serving.profiles import (
    FULL,
    GATEWAY,
    LLAMACPP,
    LLAMACPP_BASE,
    LORAMESH,
    LORAMESH_UP,
    MERGED,
    NO_UNIFIED_POOL,
    PADDED_BMM,
    PEER_SYSTEMS,
    PEFT,
    QUICK,
    experiments,
)


def test_quick_profile_covers_the_comparisons_and_ablations_without_duplicates():
    everything = experiments(QUICK)
    keys = [e.key for e in everything]
    assert len(keys) == len(set(keys))
    runs = [e for e in everything if e.system not in PEER_SYSTEMS]
    systems = {e.system for e in runs}
    assert systems == {LORAMESH, GATEWAY, PEFT, MERGED, PADDED_BMM, NO_UNIFIED_POOL}
    base = QUICK.workload
    default = [e for e in runs if e.workload.rate == base.rate and e.workload.cv == base.cv]
    # The PEFT comparison and the ablations run on the same saturating trace as loramesh at n=100.
    at_100 = {e.system for e in default if e.workload.adapters == 100}
    assert at_100 == systems
    assert {e.workload.adapters for e in default if e.system == LORAMESH} == {10, 100, 2000}
    assert set(QUICK.workload.ranks) == {8, 16}
    both = next(e for e in default if e.system == LORAMESH and e.workload.adapters == 100)
    assert {"adapters", "comparison", "rate"} <= set(both.sweeps)
    assert {e.workload.cv for e in runs if "cv" in e.sweeps} == set(QUICK.cvs)


def test_full_profile_sweeps_more_points():
    assert len(experiments(FULL)) > len(experiments(QUICK))
    assert FULL.workload.duration_s > QUICK.workload.duration_s


def test_the_llamacpp_comparison_runs_its_three_systems_on_one_saturating_trace():
    peers = [e for e in experiments(QUICK) if "llamacpp" in e.sweeps]
    assert [e.system for e in peers] == [LORAMESH_UP, LLAMACPP, LLAMACPP_BASE]
    (workload,) = {e.workload for e in peers}
    assert (workload.adapters, workload.rate) == (100, 8.0)
    assert all(e.sweeps == ("llamacpp",) for e in peers)
