"""Simulator vs the real engine on one worker: the same trace, throughput and mean latency.

The real side is the in-process engine replay of ``bench/systems/engine_system.py`` (the worker's
request path without gRPC: adapters read from disk on demand, wall clock); the simulated side is
:class:`ClusterSimulator` with one worker and the calibration's cost model and adapter load time.
Error = (simulated − measured) / measured. The real side's figures move with whatever else runs
on the machine; record the load next to them.

The calibration keeps each step's *fastest* of three runs (the engine's own cost), while a replay
on a shared machine meets the typical, contended step; near saturation that gap decides the
queueing. So the run also records every real step (tokens, adapters, seconds from its start to
the next plan: the forward pass, sampling, emitting), reports measured over calibrated step time, and ``--step-fit`` simulates with a model
fitted on another run's recorded steps (e.g. the 60% run's, to predict the 90% run: the same
machine under the same kind of load, fitted out of sample); ``--measured`` reuses an earlier
run's real side instead of replaying again.

    .venv/bin/python -m bench.cluster_sim.validate --out bench/results/cluster_sim/validation.json
    .venv/bin/python -m bench.cluster_sim.validate --load 0.9 --duration 90 \
        --step-fit bench/results/cluster_sim/validation.json --out bench/results/cluster_sim/validation_load90.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from bench.cluster_sim.calibrate import fit
from bench.cluster_sim.cost_model import Calibration, StepCostModel, StepShape
from bench.cluster_sim.experiment import capacity_rps
from bench.cluster_sim.simulator import ClusterSimulator, SimConfig
from bench.cluster_sim.worker import WorkerSpec
from bench.serving.adapters import ensure_adapter_set
from bench.systems.base import RunContext
from bench.systems.engine_system import EngineSystem, EngineSystemOptions
from bench.workload import WorkloadSpec, generate
from services.gpu_worker.engine.policies.batch_policy import BatchPlan, BatchView, StepOutcome
from services.gpu_worker.engine.policies.fcfs import Fcfs
from services.runtime.base_model import load_base_model_spec
from services.scheduler.policies.round_robin import RoundRobin

INPUT_RANGE = (8, 64)
OUTPUT_RANGE = (8, 64)
RANKS = (8, 64)
MAX_BATCH = 16
POOL_MIB = 256
HOST_CACHE_MIB = 64
IDLE_GAP_S = 0.05
"""A pause longer than this between a step's end and the next plan is idling, not overhead."""
KV_TOKEN_BYTES = 30 * 2 * 3 * 64 * 4
"""SmolLM2-135M's KV per token in fp32 (30 layers, K and V, 3 KV heads of 64): the unit of the
simulated pool and host cache (a rank-r adapter on q/k/v/o is 10·r of them)."""


def figures(arrivals, finishes) -> dict:
    """Completed requests per second (first arrival to last finish) and mean latency."""
    done = [(a, f) for a, f in zip(arrivals, finishes, strict=True) if f is not None]
    span = max(f for _, f in done) - min(arrivals)
    return {"completed": len(done), "throughput_rps": len(done) / span,
            "mean_latency_s": float(np.mean([f - a for a, f in done]))}  # fmt: skip


class RecordingFcfs(Fcfs):
    """The engine's default FCFS policy, keeping what every step cost: from planning it (then
    admitting, building the batch, the forward pass, sampling, emitting) to planning the next,
    unless the engine idled in between."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, float]] = []
        """(tokens computed, distinct adapters, seconds) per step."""
        self._started = 0.0
        self._ended: float | None = None
        self._shape = (0, 0)

    def plan(self, view: BatchView) -> BatchPlan:
        now = time.monotonic()
        if self._ended is not None:
            # A long gap after a step is the engine idling for arrivals, not the step's work.
            end = now if now - self._ended < IDLE_GAP_S else self._ended
            self.steps.append((*self._shape, end - self._started))
            self._ended = None
        self._started = now
        return super().plan(view)

    def observe(self, outcome: StepOutcome) -> None:
        self._ended = time.monotonic()
        self._shape = (outcome.prefill_tokens + outcome.decode_tokens, outcome.adapters)


def step_shape(tokens: int, adapters: int) -> StepShape:
    """A recorded step's shape; its ranks are not recorded, so every token gets the mean rank."""
    return StepShape(tokens, adapters, int(tokens * sum(RANKS) / len(RANKS)), 0.0)


def fit_steps(steps: list[list[float]]) -> tuple[StepCostModel, float]:
    """The step-cost model fitted on a validation run's recorded steps (see the module docstring)."""
    return fit([(step_shape(int(t), int(a)), 1000.0 * s) for t, a, s in steps])


def step_model_ratio(model: StepCostModel, steps: list[list[float]]) -> float:
    """Mean of measured over predicted step time."""
    return float(np.mean([1000.0 * s / model.step_ms(step_shape(int(t), int(a))) for t, a, s in steps]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", default="bench/results/cluster_sim_calibration.json")
    parser.add_argument("--load", type=float, default=0.6, help="offered load / estimated capacity")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--out", default="bench/results/cluster_sim/validation.json")
    parser.add_argument("--measured", help="take the real side (and its steps) from this earlier result")
    parser.add_argument(
        "--step-fit", help="simulate with a step model fitted on this result's recorded steps"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # as calibrated
    calibration = Calibration.load(args.calibration)
    spec = WorkerSpec(
        max_running=MAX_BATCH,
        memory_tokens=POOL_MIB * 2**20 // KV_TOKEN_BYTES,
        adapter_load_ms=calibration.adapter_load_ms,
        host_cache_tokens=HOST_CACHE_MIB * 2**20 // KV_TOKEN_BYTES,
    )
    rate = args.load * capacity_rps(calibration.model, spec, INPUT_RANGE, OUTPUT_RANGE, RANKS)
    trace = generate(WorkloadSpec(adapters=8, alpha=1.0, rate=rate, cv=1.0, input_range=INPUT_RANGE,
                                  output_range=OUTPUT_RANGE, ranks=RANKS, duration_s=args.duration))  # fmt: skip
    model, fitted_on = calibration.model, args.calibration
    if args.step_fit:
        model, fit_error = fit_steps(json.loads(Path(args.step_fit).read_text())["real_steps"])
        fitted_on = f"{args.step_fit} (fit error {fit_error:.0f}%)"
    simulated = ClusterSimulator(SimConfig(workers=1, worker=spec), model, RoundRobin()).run(trace)
    sim = figures([r.arrival_s for r in simulated.requests], [r.finish_s for r in simulated.requests])
    if args.measured:
        earlier = json.loads(Path(args.measured).read_text())
        real, steps, load = earlier["measured"], earlier["real_steps"], earlier["load_average"]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            adapters = ensure_adapter_set(Path(tmp), load_base_model_spec(), 8, RANKS)
            context = RunContext(trace=trace, adapters=adapters, window_s=math.inf, max_batch=MAX_BATCH,
                                 pool_mib=POOL_MIB, host_cache_mib=HOST_CACHE_MIB)  # fmt: skip
            recorder = RecordingFcfs()
            records = EngineSystem(EngineSystemOptions(batch_policy=lambda: recorder)).run(context)
        real = figures([r.arrival_s for r in records], [r.finish_s for r in records])
        steps, load = recorder.steps, os.getloadavg()
    error = {k: (sim[k] - real[k]) / real[k] for k in ("throughput_rps", "mean_latency_s")}
    result = {"requests": len(trace), "rate_rps": rate, "measured": real, "simulated": sim, "error": error,
              "step_model": asdict(model), "step_model_from": fitted_on,
              "measured_over_calibrated_step": step_model_ratio(calibration.model, steps),
              "cpu_model": calibration.cpu_model, "load_average": load, "real_steps": steps}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "real_steps"}, indent=1))


if __name__ == "__main__":
    main()
