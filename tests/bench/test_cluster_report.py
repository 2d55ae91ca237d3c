"""The issue-16 report's ratio tables and the experiment's batch-balancing policy sets."""

from __future__ import annotations

import json
import sys

from bench.cluster_sim import report
from bench.cluster_sim.cost_model import SHAPE_TERMS, Calibration
from bench.cluster_sim.experiment import POLICY_SETS, batch_balancing_config, simulator_factory
from services.gpu_worker.engine.policies.linear_cost import LinearCost
from services.scheduler.placement import WaitModel
from services.scheduler.policies.batch_balancing import BatchBalancing

META = {"cpu_model": "test", "capacity_rps_per_worker": 0.2, "load": 0.85, "slo_s": 20.0, "adapters": 10,
        "duration_s": 60.0}  # fmt: skip


def row(seed: int, policy: str, p99: float) -> dict:
    return {"seed": seed, "workers": 16, "trace": "bursty", "policy": policy, "p50_latency_s": p99 / 2,
            "p99_latency_s": p99, "decode_bound_p99_s": p99, "slo_attainment": 1.0, "throughput_rps": 1.0,
            "tokens_per_s": 100.0, "migrations_per_min": 0.0, "prefetches": 0, "preemptions": 0}  # fmt: skip


def test_one_ratio_table_per_combination_present(tmp_path):
    rows = [row(0, "LEW", 150.0), row(0, "LEW+batch-balancing", 100.0), row(1, "LEW", 120.0),
            row(1, "LEW+batch-balancing", 160.0)]  # fmt: skip
    report.write_report(tmp_path, META, rows)
    text = (tmp_path / "results.md").read_text()
    assert "LEW's p99 over LEW+batch-balancing's, per seed:" in text
    assert "| 16 | bursty | 1.50× | 0.75× |" in text
    assert "LEW+prefetch+co-migration's" not in text and "LEW+prefetch+batch-balancing's" not in text
    assert (tmp_path / "p99.png").stat().st_size > 0


def test_the_batch_balancing_sets_use_the_calibrated_step_model():
    model = LinearCost.named(
        SHAPE_TERMS, base_ms=200.0, per_token_ms=8.0, per_adapter_ms=18.0, per_rank_token_ms=0.01
    )
    calibration = Calibration(
        model, adapter_load_ms=600.0, cpu_model="test", samples=1, mean_abs_error_pct=0.0
    )
    config = batch_balancing_config(calibration)
    assert (config.step_token_ms, config.step_adapter_ms, config.adapter_load_s) == (8.3, 18.0, 0.6)
    for name in ("LEW+batch-balancing", "LEW+prefetch+batch-balancing"):
        policies = next(p for p in POLICY_SETS if p.name == name)
        simulator = simulator_factory(policies, 4, calibration, WaitModel())()
        assert isinstance(simulator.migration, BatchBalancing)
        assert (simulator.prefetch is not None) == ("prefetch" in name)


def test_runs_merge_grouped_by_seed_and_a_run_given_twice_counts_once(tmp_path, monkeypatch):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(
        json.dumps({"meta": META, "rows": [row(0, "LEW", 150.0), row(0, "LEW+batch-balancing", 100.0)]})
    )
    second.write_text(json.dumps({"meta": META, "rows": [row(1, "LEW", 120.0), row(0, "LEW", 150.0)]}))
    monkeypatch.setattr(
        sys,
        "argv",
        ["report", "--inputs", str(first), str(second), "--out", str(tmp_path), "--table", "16:1"],
    )
    report.main()
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["seed"], r["policy"]) for r in rows] == [(0, "LEW"), (0, "LEW+batch-balancing"), (1, "LEW")]
    table = (tmp_path / "results.md").read_text().split("\n\nLEW's p99")[0]
    assert "| 16 | 1 | bursty | LEW |" in table and "| 16 | 0 |" not in table
