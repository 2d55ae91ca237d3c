"""Hypothesis check for batch balancing (issue 16): do the p99 requests decode in oversized batches?

    .venv/bin/python -m bench.cluster_sim.batch_analysis WORKERS SEED [POLICY [TRACE PREFIX ...]]

Replays the experiment's traces (load 0.85, 600 s, 1,000 adapters) under one of its policy sets
(default LEW) with every step recorded (worker, start, end, batch size). Per trace it prints one
JSON line, and writes them all to ``bench/out/cluster_sim/batch_balancing/hypothesis/
an_WORKERS_SEED_POLICY.json``: the p99
requests (latency ≥ 0.97 × p99), the mean batch they decoded in and its excess over the
cluster's mean batch at the same moment, the spread of the workers' batches, and the p99 had
every worker carried the same share of the step work at every instant (work conserved, moves
free) — an optimistic bound for any policy that only redistributes load.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from bench.cluster_sim import experiment as ex
from bench.cluster_sim.cost_model import DEFAULT_CALIBRATION, Calibration
from bench.cluster_sim.summary import summarize
from bench.out_dir import default_out
from services.scheduler.placement import WaitModel

GRID_S = 0.5
"""Resolution of the per-worker time series."""
OUT_DIR = default_out("cluster_sim") / "batch_balancing" / "hypothesis"


def record_steps(sim, steps: list, per_request: dict) -> None:
    """Wrap every worker's ``start_step`` to log (worker, start, end, batch) and, per decoding
    request, (start, batch)."""
    for index, worker in enumerate(sim.workers.values()):

        def wrapped(now, index=index, start=worker.start_step):
            step = start(now)
            if step is not None:
                batch = len(step.prefill) + len(step.decode)
                steps.append((index, now, step.end_s, batch))
                for request in step.decode:
                    per_request.setdefault(request.request_id, []).append((now, batch))
            return step

        worker.start_step = wrapped


def analyze(workers: int, trace_name: str, trace, policies, calibration, model) -> dict:
    sim = ex.simulator_factory(policies, workers, calibration, model)()
    steps: list[tuple[int, float, float, int]] = []
    per_request: dict[str, list[tuple[float, int]]] = {}
    record_steps(sim, steps, per_request)
    result = sim.run(trace)
    summary = summarize(result, 20.0)
    done = [r for r in result.requests if r.finish_s is not None]
    latency = np.array([r.finish_s - r.arrival_s for r in done])
    p99 = np.percentile(latency, 99)
    top = [r for r in done if r.finish_s - r.arrival_s >= 0.97 * p99 and r.request_id in per_request]

    base_s = calibration.model["base_ms"] / 1000.0
    cells = int(np.ceil(max(end for _, _, end, _ in steps) / GRID_S))
    batch = np.zeros((workers, cells))
    excess = np.zeros((workers, cells))  # step time over the fixed part
    for index, start, end, size in steps:
        first, last = int(start / GRID_S), int(np.ceil(end / GRID_S))
        batch[index, first:last] = size
        excess[index, first:last] = (end - start) - base_s
    # Evened out: every worker spends the mean share of its time on the variable part of a step.
    share = np.where(batch > 0, excess / (excess + base_s), 0.0)
    even_step_s = base_s / (1 - share.mean(0))

    def even_latency(request) -> float:
        left, cell = request.output_len - 1, int(request.first_token_s / GRID_S)
        while left > 0 and cell < cells:
            left -= GRID_S / even_step_s[cell]
            cell += 1
        return cell * GRID_S - request.arrival_s

    even_p99 = np.percentile([even_latency(r) for r in done], 99)
    mean_batch = batch.mean(0)
    active = mean_batch > 0

    def same_moment_excess(request) -> float:
        return float(
            np.mean(
                [b - mean_batch[min(int(t / GRID_S), cells - 1)] for t, b in per_request[request.request_id]]
            )
        )

    return {
        "trace": trace_name,
        "p50": float(np.percentile(latency, 50)),
        "p99": float(p99),
        "p99_decode": summary.decode_bound_p99_s,
        "p99_wait": float(np.percentile([r.first_token_s - r.arrival_s for r in done], 99)),
        "top_n": len(top),
        "top_output_mean": float(np.mean([r.output_len for r in top])),
        "top_mean_batch": float(np.mean([np.mean([b for _, b in per_request[r.request_id]]) for r in top])),
        "all_req_mean_batch": float(np.mean([np.mean([b for _, b in v]) for v in per_request.values()])),
        "cluster_mean_batch": float(mean_batch[active].mean()),
        "worker_batch_std_mean": float(batch.std(0)[active].mean()),
        "batch_maxmin_spread_mean": float((batch.max(0) - batch.min(0))[active].mean()),
        "batch_hist": np.histogram(batch[:, active].ravel(), bins=[0, 1, 5, 10, 15, 20, 25, 30, 33])[
            0
        ].tolist(),
        "top_batch_minus_cluster_mean_same_time": float(np.mean([same_moment_excess(r) for r in top])),
        "ideal_even_p99": float(even_p99),
        "ratio_lew_over_even": float(p99 / even_p99),
    }


def main() -> None:
    workers, seed = int(sys.argv[1]), int(sys.argv[2])
    name = sys.argv[3] if len(sys.argv) > 3 else "LEW"
    only = tuple(sys.argv[4:])
    calibration = Calibration.load(DEFAULT_CALIBRATION)
    rate = 0.85 * ex.capacity_rps(calibration.model, ex.WORKER) * workers
    model = WaitModel(
        adapter_load_ms=calibration.adapter_load_ms,
        mean_output_tokens=sum(ex.OUTPUT_RANGE) / 2,
        max_running_hint=ex.WORKER.max_running,
        per_request_step_ms=calibration.model["per_token_ms"]
        + calibration.model["per_rank_token_ms"] * sum(ex.RANKS) / len(ex.RANKS),
    )
    policies = next(p for p in ex.POLICY_SETS if p.name == name)
    out = {}
    for trace_name, trace in ex.traces(rate, 600.0, 1000, seed).items():
        if not only or trace_name.startswith(only):
            out[trace_name] = analyze(workers, trace_name, trace, policies, calibration, model)
            print(json.dumps(out[trace_name]), flush=True)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / f"an_{workers}_{seed}_{name}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
