"""Simulator vs the real engine on one worker: the same trace, throughput and mean latency.

The real side is the in-process engine replay of ``bench/systems/engine_system.py`` (the worker's
request path without gRPC: adapters read from disk on demand, wall clock); the simulated side is
:class:`ClusterSimulator` with one worker and the calibration's cost model and adapter load time.
Error = (simulated − measured) / measured. The real side's figures move with whatever else runs
on the machine; record the load next to them.

    .venv/bin/python -m bench.cluster_sim.validate --out bench/results/cluster_sim/validation.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.cluster_sim.cost_model import Calibration
from bench.cluster_sim.experiment import capacity_rps
from bench.cluster_sim.simulator import ClusterSimulator, SimConfig
from bench.cluster_sim.worker import WorkerSpec
from bench.serving.adapters import ensure_adapter_set
from bench.systems.base import RunContext
from bench.systems.engine_system import EngineSystem
from bench.workload import WorkloadSpec, generate
from services.runtime.base_model import load_base_model_spec
from services.scheduler.policies.round_robin import RoundRobin

INPUT_RANGE = (8, 64)
OUTPUT_RANGE = (8, 64)
RANKS = (8, 64)
MAX_BATCH = 16


def figures(arrivals, finishes) -> dict:
    """Completed requests per second (first arrival to last finish) and mean latency."""
    done = [(a, f) for a, f in zip(arrivals, finishes, strict=True) if f is not None]
    span = max(f for _, f in done) - min(arrivals)
    return {"completed": len(done), "throughput_rps": len(done) / span,
            "mean_latency_s": float(np.mean([f - a for a, f in done]))}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", default="bench/results/cluster_sim_calibration.json")
    parser.add_argument("--load", type=float, default=0.6, help="offered load / estimated capacity")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--out", default="bench/results/cluster_sim/validation.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as calibrated
    calibration = Calibration.load(args.calibration)
    spec = WorkerSpec(max_running=MAX_BATCH, memory_tokens=5600, adapter_load_ms=calibration.adapter_load_ms)
    rate = args.load * capacity_rps(calibration.model, spec, INPUT_RANGE, OUTPUT_RANGE, RANKS)
    trace = generate(WorkloadSpec(adapters=8, alpha=1.0, rate=rate, cv=1.0, input_range=INPUT_RANGE,
                                  output_range=OUTPUT_RANGE, ranks=RANKS, duration_s=args.duration))  # fmt: skip
    simulated = ClusterSimulator(SimConfig(workers=1, worker=spec), calibration.model, RoundRobin()).run(
        trace
    )
    sim = figures([r.arrival_s for r in simulated.requests], [r.finish_s for r in simulated.requests])
    with tempfile.TemporaryDirectory() as tmp:
        adapters = ensure_adapter_set(Path(tmp), load_base_model_spec(), 8, RANKS)
        context = RunContext(trace=trace, adapters=adapters, window_s=math.inf, max_batch=MAX_BATCH,
                             pool_mib=256, host_cache_mib=64)  # fmt: skip
        records = EngineSystem().run(context)
    real = figures([r.arrival_s for r in records], [r.finish_s for r in records])
    error = {k: (sim[k] - real[k]) / real[k] for k in ("throughput_rps", "mean_latency_s")}
    result = {"requests": len(trace), "rate_rps": rate, "measured": real, "simulated": sim, "error": error,
              "cpu_model": calibration.cpu_model, "load_average": os.getloadavg()}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
