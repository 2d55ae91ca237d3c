"""The cluster simulator on tiny hand-made traces with a hand-made cost model: exact times.

Cost model: every step costs 10 ms plus 1 ms per computed token; adapters load in 100 ms.
"""

from __future__ import annotations

import pytest

from bench.cluster_sim.cost_model import DEFAULT_CALIBRATION, SHAPE_TERMS, Calibration, StepShape, shape_of
from bench.cluster_sim.simulator import ClusterSimulator, SimConfig
from bench.cluster_sim.summary import summarize
from bench.cluster_sim.validate import fit_steps, step_model_ratio, step_shape
from bench.cluster_sim.worker import WorkerSpec
from bench.workload import TraceRequest, WorkloadSpec, generate
from services.gpu_worker.engine.policies.linear_cost import LinearCost
from services.scheduler.cluster_view import ClusterSnapshot
from services.scheduler.placement import PlacementDecision, PlacementRequest, WaitModel
from services.scheduler.policies.least_estimated_wait import LeastEstimatedWait
from services.scheduler.policies.replica_load import ClusterLoad, Migration
from services.scheduler.policies.round_robin import RoundRobin

COST = LinearCost.named(SHAPE_TERMS, base_ms=10.0, per_token_ms=1.0)
SPEC = WorkerSpec(max_running=8, memory_tokens=10_000, adapter_load_ms=100.0)


def request(time_s: float, input_len: int, output_len: int, adapter: int = 0, rid: str = "") -> TraceRequest:
    return TraceRequest(time_s, adapter, 8, input_len, output_len, rid or f"r{time_s}-{adapter}")


class Always:
    """Places everything on one worker."""

    name = "always"

    def __init__(self, worker_id: str):
        self.worker_id = worker_id

    def place(self, snapshot: ClusterSnapshot, request: PlacementRequest) -> PlacementDecision:
        return PlacementDecision(self.worker_id, "", 0.0, True)


class MoveOnce:
    """Moves one request once, at its first round."""

    name = "move-once"

    def __init__(self, move: Migration):
        self.move: Migration | None = move
        self.seen: list[ClusterLoad] = []

    def interval_s(self) -> float:
        return 0.05

    def plan(self, cluster: ClusterLoad) -> list[Migration]:
        self.seen.append(cluster)
        move, self.move = self.move, None
        return [move] if move else []


def simulate(trace, placement, workers=1, spec=SPEC, migration=None):
    sim = ClusterSimulator(SimConfig(workers=workers, worker=spec), COST, placement, migration)
    return sim.run(trace)


def times(result) -> dict[str, tuple[float, float]]:
    return {r.request_id: (r.first_token_s, r.finish_s) for r in result.requests}


def test_step_shape_counts_tokens_adapters_rank_tokens_and_attention():
    shape = shape_of([(5, 0, 8, "a"), (1, 20, 16, "b"), (1, 30, 8, "a")])
    assert shape == StepShape(
        tokens=7, adapters=2, rank_tokens=5 * 8 + 16 + 8, attention_units=12.5 + 20.5 + 30.5
    )
    assert COST.predict(shape.row()) == 17.0


def test_one_request_waits_for_its_adapter_then_prefills_and_decodes():
    result = simulate([request(0.0, 5, 3, rid="a")], Always("w000"))
    # load 0.100; prefill 5 tokens 15 ms -> first token 0.115; two decodes of 11 ms.
    assert times(result)["a"] == (pytest.approx(0.115), pytest.approx(0.137))
    assert result.migrations == 0 and result.end_s == pytest.approx(0.5)  # the report after it


def test_a_request_arriving_mid_step_joins_the_batch_at_the_next_step():
    trace = [request(0.0, 5, 3, rid="a"), request(0.11, 4, 3, rid="b")]
    got = times(simulate(trace, Always("w000")))
    # 0.115 a prefilled; step [b prefill 4 + a decode 1] 15 ms -> 0.130; [a, b] 12 ms -> 0.142
    # (a done); [b] 11 ms -> 0.153.
    assert got["a"] == (pytest.approx(0.115), pytest.approx(0.142))
    assert got["b"] == (pytest.approx(0.130), pytest.approx(0.153))


def test_a_full_batch_makes_the_next_request_queue_and_memory_bounds_admission():
    spec = WorkerSpec(max_running=1, memory_tokens=10_000, adapter_load_ms=100.0)
    got = times(
        simulate([request(0.0, 10, 2, rid="a"), request(0.0, 10, 2, rid="b")], Always("w000"), spec=spec)
    )
    # a: 0.100 + 20 ms = 0.120, + 11 ms = 0.131; then b: 0.151, 0.162.
    assert got["a"] == (pytest.approx(0.120), pytest.approx(0.131))
    assert got["b"] == (pytest.approx(0.151), pytest.approx(0.162))
    # A pool that holds the adapter (80 tokens) and one prompt (10) but not two: b waits.
    tight = WorkerSpec(max_running=8, memory_tokens=95, adapter_load_ms=100.0)
    assert times(simulate([request(0.0, 10, 2, rid="a"), request(0.0, 10, 2, rid="b")], Always("w000"),
                          spec=tight)) == got  # fmt: skip


def test_a_pool_that_runs_dry_preempts_the_newest_request_which_recomputes_its_context():
    # 100 tokens: the adapter (80) and both prompts (10 + 10) fit, so both start; their next
    # token does not (80 + 11 + 11), so b is preempted and recomputes 11 tokens after a ends.
    tight = WorkerSpec(max_running=8, memory_tokens=100, adapter_load_ms=100.0)
    result = simulate(
        [request(0.0, 10, 2, rid="a"), request(0.0, 10, 2, rid="b")], Always("w000"), spec=tight
    )
    # Prefill of 20 tokens 30 ms -> 0.130 (both first tokens); a decodes alone 11 ms -> 0.141;
    # b prefills its 11 tokens 21 ms -> 0.162, its last token.
    assert times(result) == {"a": (pytest.approx(0.130), pytest.approx(0.141)),
                             "b": (pytest.approx(0.130), pytest.approx(0.162))}  # fmt: skip
    assert [r.preemptions for r in result.requests] == [0, 1]


def test_the_simulated_worker_preempts_whom_its_preemption_policy_names():
    # a has the longer prompt (12 vs 10): newest preempts b, fewest_computed preempts b too (the
    # shorter context); with b the longer one, fewest_computed preempts a instead.
    def preempted(policy: str, a_len: int, b_len: int) -> list[int]:
        spec = WorkerSpec(max_running=8, memory_tokens=80 + a_len + b_len, adapter_load_ms=100.0,
                          preemption_policy=policy)  # fmt: skip
        trace = [request(0.0, a_len, 2, rid="a"), request(0.0, b_len, 2, rid="b")]
        return [r.preemptions for r in simulate(trace, Always("w000"), spec=spec).requests]

    assert preempted("newest", 12, 10) == [0, 1]
    assert preempted("fewest_computed", 12, 10) == [0, 1]
    assert preempted("newest", 10, 12) == [0, 1]
    assert preempted("fewest_computed", 10, 12) == [1, 0]


def test_migration_moves_a_queued_request_with_its_adapter_and_is_counted():
    spec = WorkerSpec(max_running=1, memory_tokens=10_000, adapter_load_ms=100.0)
    trace = [request(0.0, 10, 10, rid="long"), request(0.0, 10, 2, rid="short")]
    mover = MoveOnce(Migration("short", "a0", "w000", "w001"))
    result = simulate(trace, Always("w000"), workers=2, spec=spec, migration=mover)
    got = times(result)
    # long: 0.100 + 20 ms prefill, 9 decodes of 11 ms -> 0.219. short moved at 0.05: its adapter
    # loads on w001 until 0.150, prefill 0.170, decode 0.181. Unmoved it would finish at 0.250.
    assert got["long"] == (pytest.approx(0.120), pytest.approx(0.219))
    assert got["short"] == (pytest.approx(0.170), pytest.approx(0.181))
    assert result.migrations == 1
    first = mover.seen[0]
    w0 = first.replicas[0]
    assert [r.request_id for r in w0.requests] == ["long", "short"]
    assert w0.queue_delay_s == pytest.approx(0.05) and w0.invocations == {"a0": 2}
    assert first.adapter_rates == {"a0": pytest.approx(2 / 0.05)} and first.adapter_sizes == {"a0": 80}


def test_a_running_request_migrates_as_tokens_and_recomputes_its_context():
    trace = [request(0.0, 10, 10, rid="x")]
    mover = MoveOnce(Migration("x", "a0", "w000", "w001"))
    mover.interval_s = lambda: 0.125  # after the prefill (0.120) and mid-way through a decode
    got = times(simulate(trace, Always("w000"), workers=2, migration=mover))
    # First token at 0.120 on w000; the decode in flight is lost; w001 loads a0 until 0.225,
    # prefills 11 tokens (21 ms) -> 2nd token at 0.246, 8 decodes of 11 ms -> 0.334.
    assert got["x"] == (pytest.approx(0.120), pytest.approx(0.334))


def test_round_robin_through_the_real_policy_spreads_requests():
    trace = [request(0.0, 5, 2, rid="a"), request(0.0, 5, 2, rid="b")]
    result = simulate(trace, RoundRobin(), workers=2)
    assert {r.request_id: r.worker for r in result.requests} == {"a": "w000", "b": "w001"}
    assert times(result)["a"] == times(result)["b"] == (pytest.approx(0.115), pytest.approx(0.126))


def test_same_trace_same_policies_same_result_and_a_summary():
    trace = generate(WorkloadSpec(adapters=20, alpha=1.0, rate=40, cv=3, duration_s=5, seed=3))
    model = WaitModel(mean_output_tokens=68, per_request_step_ms=5)
    runs = [simulate(trace, LeastEstimatedWait(model), workers=3) for _ in range(2)]
    assert times(runs[0]) == times(runs[1])
    summary = summarize(runs[0], slo_s=1.0)
    assert summary.finished == summary.requests == len(trace) > 100
    assert 0 < summary.p50_latency_s <= summary.p99_latency_s and 0 <= summary.slo_attainment <= 1


def test_a_host_cache_too_small_for_two_adapters_fetches_one_again():
    # Host RAM for one rank-8 adapter (80 tokens): b's copy replaces a's once a is done, so
    # the second request for a waits for a new fetch. Unbounded, it would not.
    trace = [request(0.0, 5, 1, adapter=0, rid="a1"), request(0.2, 5, 1, adapter=1, rid="b"),
             request(0.4, 5, 1, adapter=0, rid="a2")]  # fmt: skip
    small = WorkerSpec(max_running=8, memory_tokens=10_000, adapter_load_ms=100.0, host_cache_tokens=80)
    # a2 arrives at 0.4, its adapter lands at 0.5, prefill 15 ms.
    assert times(simulate(trace, Always("w000"), spec=small))["a2"] == (pytest.approx(0.515),) * 2
    assert times(simulate(trace, Always("w000")))["a2"] == (pytest.approx(0.415),) * 2


def test_a_migrated_request_joins_the_back_of_the_queue_or_keeps_its_arrival_order():
    # w001 runs one request at a time and has "late" (arrived at 0.01) queued behind "busy";
    # "early" (arrived at 0.0 on w000) moves there at 0.05.
    spec = WorkerSpec(max_running=1, memory_tokens=10_000, adapter_load_ms=100.0)
    trace = [
        request(0.0, 10, 10, rid="early"),
        request(0.0, 10, 10, rid="busy"),
        request(0.01, 10, 2, rid="late"),
    ]

    class Split:
        name = "split"

        def place(self, snapshot: ClusterSnapshot, wanted: PlacementRequest) -> PlacementDecision:
            return PlacementDecision("w000" if wanted.request_id == "early" else "w001", "", 0.0, True)

    def finish_order(keep_place: bool) -> list[str]:
        config = SimConfig(workers=2, worker=spec, migrated_keep_place=keep_place)
        mover = MoveOnce(Migration("early", "a0", "w000", "w001"))
        sim = ClusterSimulator(config, COST, Split(), mover)
        done = [r for r in sim.run(trace).requests if r.worker == "w001"]
        return [r.request_id for r in sorted(done, key=lambda r: r.finish_s)]

    assert finish_order(keep_place=False) == ["busy", "late", "early"]
    assert finish_order(keep_place=True) == ["busy", "early", "late"]


def test_a_step_model_fitted_on_recorded_steps_predicts_them():
    truth = LinearCost.named(SHAPE_TERMS, base_ms=200.0, per_token_ms=5.0, per_adapter_ms=20.0)
    steps = [
        [t, a, truth.predict(step_shape(t, a).row()) / 1000.0] for t in (1, 8, 16, 64) for a in (1, 4, 8)
    ]
    model, error_pct = fit_steps(steps)
    assert error_pct == pytest.approx(0.0, abs=1e-6)
    assert step_model_ratio(model, steps) == pytest.approx(1.0)
    assert step_model_ratio(truth, [[t, a, 2 * s] for t, a, s in steps]) == pytest.approx(2.0)


def test_the_committed_calibrations_load_and_save_back_unchanged(tmp_path):
    for path in sorted(DEFAULT_CALIBRATION.parent.glob("*.json")):
        calibration = Calibration.load(path)
        assert calibration.model.terms == SHAPE_TERMS and calibration.model["base_ms"] > 0
        calibration.save(tmp_path / path.name)
        assert (tmp_path / path.name).read_text() == path.read_text()
