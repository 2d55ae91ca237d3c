"""HRRN vs FCFS on a real worker's engine (issue 16; SEED-SPECS §3 "Reproducible here" 3).

The engine (SmolLM2-135M, continuous batching, ``--max-running`` requests at once so a queue
forms) serves one Poisson trace of real prompts of mixed lengths (the length data set's rows,
each generating its real length) twice: with the ``fcfs`` batch policy, and with ``hrrn`` over
the cross-fitted predicted lengths the requests carry (and, as a bound, over the real lengths).
The rate is ``--load`` times the capacity measured first (a backlog served by FCFS); with
``--backlog`` every request arrives at once instead (HRRN is then shortest predicted first, and
the comparison does not depend on a capacity measured under another load).

    .venv/bin/python -m bench.magnus.hrrn_vs_fcfs [--requests 80] [--load 0.8] [--backlog]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

from bench.magnus import length_dataset
from bench.magnus.engine_runs import EngineRunner, replay_continuous, summary
from bench.magnus.length_error import RESULTS
from bench.magnus.trace import cross_fitted_predictions, poisson_trace
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.policies.fcfs import Fcfs
from services.gpu_worker.engine.policies.hrrn import Hrrn
from services.gpu_worker.model.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--load", type=float, default=0.8, help="offered load, share of the capacity")
    parser.add_argument("--max-running", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backlog", action="store_true", help="every request arrives at 0 (no rate)")
    args = parser.parse_args()

    rows = length_dataset.load(RESULTS / "length_dataset.json")
    predicted = cross_fitted_predictions(rows, args.seed)
    loaded = load_model()
    config = EngineConfig(max_running=args.max_running)

    def run(policy, trace, with_predictions: bool) -> dict:
        runner = EngineRunner(loaded, config, policy)
        try:
            return summary(replay_continuous(runner, trace, predicted=with_predictions))
        finally:
            runner.close()

    if args.backlog:
        capacity = None
        trace = [replace(r, arrival_s=0.0) for r in poisson_trace(rows, predicted, loaded.tokenizer, args.requests, 1.0, args.seed)]  # fmt: skip
    else:
        backlog = [replace(r, arrival_s=0.0) for r in poisson_trace(rows, predicted, loaded.tokenizer, args.requests // 2, 1.0, args.seed + 1)]  # fmt: skip
        capacity = run(Fcfs(), backlog, False)["throughput_rps"]
        trace = poisson_trace(
            rows, predicted, loaded.tokenizer, args.requests, args.load * capacity, args.seed
        )
    oracle = [replace(r, predicted_tokens=r.output_tokens) for r in trace]
    result = {
        "load_average_start": os.getloadavg(),
        "capacity_rps": capacity,
        "rate_rps": None if capacity is None else round(args.load * capacity, 4),
        "requests": args.requests,
        "max_running": args.max_running,
        "fcfs": run(Fcfs(), trace, False),
        "hrrn (predicted G′)": run(Hrrn(), trace, True),
        "hrrn (real G, bound)": run(Hrrn(), oracle, True),
        "load_average_end": os.getloadavg(),
    }
    (RESULTS / ("hrrn_vs_fcfs_backlog.json" if args.backlog else "hrrn_vs_fcfs.json")).write_text(
        json.dumps(result, indent=2)
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
