"""Magnus' static-batching setting on the real engine (issue 16; SEED-SPECS §3 "Reproducible
here" 2), with our continuous batching as the reference.

One instance, a KV memory Θ (token slots) sized so static FCFS (VS) can run ``--vs-batch``
worst-case requests (longest prompt, longest output) at once. On the same Poisson trace of real
prompts (real lengths G, cross-fitted predictions G′):

- VS: FCFS static batches of ``--vs-batch``;
- Magnus: WMA batch assembly over G′ under Θ and Φ, HRRN batch selection with the batch-time
  estimator (calibrated on a few measured batches first, then refitted on every batch run),
  split-and-requeue when an under-prediction overflows Θ;
- continuous: our engine, FCFS, its pool holding the same Θ of KV.

    .venv/bin/python -m bench.magnus.static_harness [--requests 60] [--rate-rps 0.6]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from bench.magnus import length_dataset
from bench.magnus.batch_time import BatchShape, MeasuredBatch, batch_time_model
from bench.magnus.engine_runs import (
    EngineRunner,
    kv_bytes_per_token,
    replay_continuous,
    replay_static,
    summary,
)
from bench.magnus.length_error import RESULTS
from bench.magnus.static_batching import (
    FcfsStatic,
    MagnusStatic,
    MagnusStaticConfig,
    StaticBatch,
    StaticRequest,
)
from bench.magnus.trace import cross_fitted_predictions, poisson_trace
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.policies.linear_cost import OnlineFit
from services.gpu_worker.model.loading import load_model

CALIBRATION = ((1, 8), (4, 8), (16, 8), (1, 48), (4, 48), (16, 48))
"""(batch size, decode steps) of the batches the estimator is calibrated on."""
VALIDATION = ((2, 24), (8, 32), (12, 16))
"""(batch size, decode steps) of the batches its error is measured on."""


def calibrate(
    runner: EngineRunner, trace: list[StaticRequest], seed: int
) -> tuple[OnlineFit[MeasuredBatch], float]:
    """An estimator fitted on measured batches, and its mean relative error on other batches."""
    rng = np.random.default_rng(seed)

    def measured(size: int, steps: int) -> tuple[BatchShape, float]:
        batch = StaticBatch([trace[int(i)] for i in rng.choice(len(trace), size=size, replace=False)])
        return batch.shape(steps), runner.run_batch(batch, steps)

    estimator = batch_time_model()
    for size, steps in CALIBRATION:
        estimator.observe(measured(size, steps))
    errors = [
        abs(estimator.cost.predict(shape.row()) - s) / s for shape, s in (measured(*v) for v in VALIDATION)
    ]
    return estimator, float(np.mean(errors))


def continuous_reference(loaded, trace: list[StaticRequest], memory_limit: int, max_batch: int) -> dict:
    """Our engine, FCFS, its pool holding Θ of KV."""
    pool_mib = memory_limit * kv_bytes_per_token(loaded) / 2**20
    reference = EngineRunner(loaded, EngineConfig(pool_mib=pool_mib, max_running=max_batch))
    try:
        return {
            "pool_mib": round(pool_mib, 1),
            **summary(replay_continuous(reference, trace, predicted=False)),
        }
    finally:
        reference.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rate-rps", type=float, default=0.6, help="Poisson arrival rate")
    parser.add_argument("--vs-batch", type=int, default=4, help="VS batch size; sets Θ")
    parser.add_argument("--max-batch", type=int, default=16, help="Magnus' and the engine's largest batch")
    parser.add_argument("--wma-limit", type=float, default=1500.0, help="Φ, in token-steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--magnus-only", action="store_true", help="skip VS and the continuous reference")
    args = parser.parse_args()

    rows = length_dataset.load(RESULTS / "length_dataset.json")
    predicted = cross_fitted_predictions(rows, args.seed)
    loaded = load_model()
    trace = poisson_trace(rows, predicted, loaded.tokenizer, args.requests, args.rate_rps, args.seed)
    worst = max(r.prompt_tokens for r in trace) + max(r.output_tokens for r in trace)
    memory_limit = args.vs_batch * worst
    result: dict = {
        "load_average_start": os.getloadavg(),
        "requests": args.requests,
        "rate_rps": args.rate_rps,
        "memory_limit_tokens": memory_limit,
        "wma_limit": args.wma_limit,
        "prediction_mae_tokens": round(
            float(np.mean([abs(r.predicted_tokens - r.output_tokens) for r in trace])), 1
        ),
    }
    runner = EngineRunner(loaded, EngineConfig(max_running=args.max_batch, max_prefill_tokens=8192))
    try:
        estimator, error = calibrate(runner, trace, args.seed)
        result["batch_time_estimator_mean_rel_error"] = round(error, 3)
        print(f"batch-time estimator: mean relative error {error:.1%} on {len(VALIDATION)} held-out batches")
        magnus = MagnusStatic(MagnusStaticConfig(args.max_batch, memory_limit, args.wma_limit), estimator)
        schedulers = (magnus,) if args.magnus_only else (FcfsStatic(args.vs_batch), magnus)
        for scheduler in schedulers:
            started = time.monotonic()
            completions, stats = replay_static(runner, scheduler, trace, memory_limit)
            result[scheduler.name] = {
                **summary(completions),
                "batches": stats.batches,
                "median_batch": float(np.median(stats.batch_sizes)),
                "overflow_splits": stats.overflows,
                "wall_s": round(time.monotonic() - started, 1),
            }
            print(scheduler.name, result[scheduler.name], flush=True)
    finally:
        runner.close()
    if not args.magnus_only:
        result["continuous FCFS (loramesh engine)"] = continuous_reference(
            loaded, trace, memory_limit, args.max_batch
        )
    result["load_average_end"] = os.getloadavg()
    name = f"static_harness_magnus_wma{args.wma_limit:g}.json" if args.magnus_only else "static_harness.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
