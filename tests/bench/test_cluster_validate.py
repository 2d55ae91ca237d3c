"""The validation's pure parts: the real side's placement replay, recorded steps per worker, the
shared timeline of two workers' replays. Nothing here runs an engine or reads a clock."""

from __future__ import annotations

from bench.cluster_sim.cost_model import SHAPE_TERMS
from bench.cluster_sim.simulator import ClusterSimulator, SimConfig
from bench.cluster_sim.validate import Share, place, pooled, steps_by_worker, worker_ids
from bench.cluster_sim.worker import WorkerSpec
from bench.systems.base import RequestRecord
from bench.workload import WorkloadSpec, generate
from services.gpu_worker.engine.policies.linear_cost import LinearCost
from services.scheduler.policies.round_robin import RoundRobin


def trace():
    return generate(WorkloadSpec(adapters=4, alpha=1.0, rate=2.0, cv=2.0, input_range=(8, 64),
                                 output_range=(8, 64), ranks=(8, 64), duration_s=20.0))  # fmt: skip


def test_round_robin_replayed_on_the_real_side_places_as_in_the_simulator():
    requests = trace()
    real = place(requests, 2, RoundRobin())
    assert real == [worker_ids(2)[i % 2] for i in range(len(requests))]
    spec = WorkerSpec(max_running=2, memory_tokens=4_000, adapter_load_ms=300.0)
    simulated = ClusterSimulator(
        SimConfig(workers=2, worker=spec), LinearCost.named(SHAPE_TERMS, base_ms=50.0), RoundRobin()
    )
    assert real == [r.worker for r in simulated.run(requests).requests]


def test_one_worker_places_everything_on_the_simulators_only_worker():
    assert set(place(trace(), 1, RoundRobin())) == {"w000"}


def test_recorded_steps_per_worker_old_flat_results_included():
    old = {"real_steps": [[8, 1, 0.3], [16, 2, 0.4]]}
    assert steps_by_worker(old) == {"w000": [[8, 1, 0.3], [16, 2, 0.4]]}
    two = {"real_steps": {"w001": [[4, 1, 0.2]], "w000": [[8, 1, 0.3]]}}
    assert steps_by_worker(two) == two["real_steps"]
    assert pooled(steps_by_worker(two)) == [[8, 1, 0.3], [4, 1, 0.2]]


def test_a_later_started_worker_is_shifted_onto_the_earlier_ones_timeline():
    records = [RequestRecord("a", 0, 1.0, 8, 8, finish_s=3.0), RequestRecord("b", 0, 2.0, 8, 8)]
    arrivals, finishes = Share(records, [], start=100.5).timeline(origin=100.0)
    assert arrivals == [1.5, 2.5]
    assert finishes == [3.5, None]
