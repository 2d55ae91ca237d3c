"""Issue 16's comparison: placement, prefetch and migration policies on 16 and 64 simulated workers.

Every run replays one trace through :class:`ClusterSimulator` with the step-cost model and adapter
load time fitted on the real engine (``calibrate.py``'s JSON). Load is set relative to the
cluster's estimated capacity (``--load``), so the figures mean the same thing on any machine's
calibration. Writes ``results.json`` (after every run) and, at the end, ``results.md`` and
``p99.png`` to ``--out``; ``report.py`` rebuilds the last two from several runs' JSON.

    .venv/bin/python -m bench.cluster_sim.experiment --seeds 0 1 2 --out bench/out/cluster_sim
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.cluster_sim.cost_model import DEFAULT_CALIBRATION, Calibration, shape_of
from bench.cluster_sim.report import write_report
from bench.cluster_sim.simulator import ClusterSimulator, SimConfig
from bench.cluster_sim.summary import summarize
from bench.cluster_sim.traces import shifted
from bench.cluster_sim.worker import WorkerSpec
from bench.out_dir import default_out
from bench.workload import TraceRequest, WorkloadSpec, generate
from services.gpu_worker.engine.policies.linear_cost import LinearCost
from services.scheduler.placement import WaitModel
from services.scheduler.policies import make_placement
from services.scheduler.policies.batch_balancing import BatchBalancing, BatchBalancingConfig
from services.scheduler.policies.burst_tolerance_prefetch import BurstToleranceConfig, BurstTolerancePrefetch
from services.scheduler.policies.co_migration import CoMigration, CoMigrationConfig
from services.scheduler.policies.pets_balancing import PetsBalancing

INPUT_RANGE = (8, 256)
OUTPUT_RANGE = (8, 256)
RANKS = (8, 16, 32, 64)
WORKER = WorkerSpec(max_running=32, memory_tokens=8192, adapter_tokens_per_rank=10)
PREFETCH = BurstToleranceConfig(max_tolerance_s=30.0)
"""Prefetch below 30 s of burst tolerance: with a pool of 8k tokens a holder absorbs ~30 requests,
so the default 4 s would prefetch only adapters held nowhere."""


@dataclass(frozen=True)
class PolicySet:
    name: str
    placement: str
    prefetch: bool = False
    migration: str = "none"
    keep_place: bool = False
    """Migrated requests keep their arrival order in the target's queue (see ``SimConfig``)."""


POLICY_SETS = (
    PolicySet("round-robin", "round-robin"),
    PolicySet("least-loaded", "least-loaded"),
    PolicySet("LEW", "least-estimated-wait"),
    PolicySet("LEW+prefetch", "least-estimated-wait", prefetch=True),
    PolicySet("LEW+co-migration", "least-estimated-wait", migration="co-migration"),
    PolicySet("LEW+PetS", "least-estimated-wait", migration="pets"),
    PolicySet("LEW+batch-balancing", "least-estimated-wait", migration="batch-balancing"),
    PolicySet("LEW+prefetch+co-migration", "least-estimated-wait", prefetch=True, migration="co-migration"),
    PolicySet(
        "LEW+prefetch+batch-balancing", "least-estimated-wait", prefetch=True, migration="batch-balancing"
    ),
    PolicySet(
        "combination, arrival-order resume",
        "least-estimated-wait",
        prefetch=True,
        migration="co-migration",
        keep_place=True,
    ),
)


def capacity_rps(
    cost: LinearCost,
    spec: WorkerSpec,
    input_range: tuple[int, int] = INPUT_RANGE,
    output_range: tuple[int, int] = OUTPUT_RANGE,
    ranks: tuple[int, ...] = RANKS,
) -> float:
    """Requests per second one worker finishes with a full batch of mean-sized requests, each
    of its own adapter (every step decodes ``max_running`` requests and prefills its share)."""
    batch = spec.max_running
    mean_in = sum(input_range) / 2
    mean_out = sum(output_range) / 2
    rank = sum(ranks) / len(ranks)
    prefills = batch / mean_out  # prompts per step in steady state
    parts = [(1, int(mean_in + mean_out / 2), int(rank), f"a{i}") for i in range(batch)]
    decode = shape_of(parts)
    step_ms = cost.predict(decode.row()) + prefills * mean_in * (
        cost["per_token_ms"] + cost["per_rank_token_ms"] * rank
    )
    return prefills / (step_ms / 1000.0)


def traces(rate: float, duration_s: float, adapters: int, seed: int) -> dict[str, list[TraceRequest]]:
    def spec(alpha: float, cv: float) -> WorkloadSpec:
        return WorkloadSpec(adapters=adapters, alpha=alpha, rate=rate, cv=cv, input_range=INPUT_RANGE,
                            output_range=OUTPUT_RANGE, ranks=RANKS, duration_s=duration_s, seed=seed)  # fmt: skip

    return {
        "steady (cv 1, α 1)": generate(spec(1.0, 1.0)),
        "bursty (cv 2, α 1)": generate(spec(1.0, 2.0)),
        "bursty (cv 8, α 1)": generate(spec(1.0, 8.0)),
        "bursty skewed (cv 4, α 2)": generate(spec(2.0, 4.0)),
        "popularity shift (cv 2, α 1.5)": shifted(spec(1.5, 2.0)),
    }


def wait_model(
    calibration: Calibration, output_range: tuple[int, int], max_running: int, ranks: tuple[int, ...]
) -> WaitModel:
    """The scheduler's wait model from the same calibration as the simulated workers: one more
    request in a batch costs a token of the mean rank."""
    mean_rank = sum(ranks) / len(ranks)
    return WaitModel(
        adapter_load_ms=calibration.adapter_load_ms,
        mean_output_tokens=sum(output_range) / 2,
        max_running_hint=max_running,
        per_request_step_ms=calibration.model["per_token_ms"]
        + calibration.model["per_rank_token_ms"] * mean_rank,
    )


def co_migration_config(calibration: Calibration, workers: int) -> CoMigrationConfig:
    """Co-migration's runtime model from the same calibration as the simulated workers: a step of
    a full batch of requests of distinct adapters of the mean rank."""
    model = calibration.model
    rank_ms = model["per_rank_token_ms"] * sum(RANKS) / len(RANKS)
    return CoMigrationConfig(
        top_k=max(2, workers // 8),
        step_base_ms=model["base_ms"],
        step_per_request_ms=model["per_token_ms"] + model["per_adapter_ms"] + rank_ms,
        prefill_token_ms=model["per_token_ms"] + rank_ms,
        adapter_load_s=calibration.adapter_load_ms / 1000.0,
        max_running=WORKER.max_running,
        mean_remaining_tokens=sum(OUTPUT_RANGE) / 2,
        slot_memory_tokens=(sum(INPUT_RANGE) + sum(OUTPUT_RANGE)) / 2,
    )


def batch_balancing_config(
    calibration: Calibration, *, min_gap: int = BatchBalancingConfig.min_gap
) -> BatchBalancingConfig:
    """Batch balancing's step model from the same calibration as the simulated workers."""
    model = calibration.model
    rank_ms = model["per_rank_token_ms"] * sum(RANKS) / len(RANKS)
    return BatchBalancingConfig(
        step_token_ms=model["per_token_ms"] + rank_ms,
        step_adapter_ms=model["per_adapter_ms"],
        prefill_token_ms=model["per_token_ms"] + rank_ms,
        adapter_load_s=calibration.adapter_load_ms / 1000.0,
        default_max_running=WORKER.max_running,
        min_gap=min_gap,
    )


def simulator_factory(
    policies: PolicySet,
    workers: int,
    calibration: Calibration,
    model: WaitModel,
    *,
    batch_min_gap: int = BatchBalancingConfig.min_gap,
) -> Callable[[], ClusterSimulator]:
    def build() -> ClusterSimulator:
        spec = WorkerSpec(**{**asdict(WORKER), "adapter_load_ms": calibration.adapter_load_ms})
        migration = {
            "none": None,
            "co-migration": CoMigration(co_migration_config(calibration, workers)),
            "pets": PetsBalancing(),
            "batch-balancing": BatchBalancing(batch_balancing_config(calibration, min_gap=batch_min_gap)),
        }[policies.migration]
        return ClusterSimulator(
            SimConfig(workers=workers, worker=spec, migrated_keep_place=policies.keep_place),
            calibration.model,
            make_placement(policies.placement, model),
            migration,
            BurstTolerancePrefetch(PREFETCH) if policies.prefetch else None,
        )

    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", default=str(DEFAULT_CALIBRATION))
    parser.add_argument("--workers", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--load", type=float, default=0.85, help="offered load / estimated capacity")
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--slo-s", type=float, default=0.0, help="first-token SLO (0: 10 x an idle prefill)")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="trace seeds (the table shows the first)"
    )
    parser.add_argument(
        "--traces", nargs="*", default=[], help="only the traces whose names start with these"
    )
    parser.add_argument("--policies", nargs="*", default=[], help="only these policy sets (by name)")
    parser.add_argument(
        "--batch-min-gap",
        type=int,
        default=BatchBalancingConfig.min_gap,
        help="batch balancing's min_gap (running batches must differ by this many requests)",
    )
    parser.add_argument("--out", default=str(default_out("cluster_sim")))
    args = parser.parse_args()
    calibration = Calibration.load(args.calibration)
    per_worker = capacity_rps(calibration.model, WORKER)
    mean_rank = sum(RANKS) / len(RANKS)
    idle_prefill = shape_of([(int(sum(INPUT_RANGE) / 2), 0, int(mean_rank), "a")])
    slo_s = (
        args.slo_s
        or 10 * (calibration.model.predict(idle_prefill.row()) + calibration.adapter_load_ms) / 1000
    )
    model = wait_model(calibration, OUTPUT_RANGE, WORKER.max_running, RANKS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"cpu_model": calibration.cpu_model, "capacity_rps_per_worker": per_worker, "slo_s": slo_s,
            "load": args.load, "duration_s": args.duration, "adapters": args.adapters, "seeds": args.seeds,
            "adapter_load_ms": calibration.adapter_load_ms, "cost_model": calibration.model.as_dict(),
            "batch_min_gap": args.batch_min_gap}  # fmt: skip
    rows = []
    for seed in args.seeds:
        for workers in args.workers:
            rate = args.load * per_worker * workers
            for trace_name, trace in traces(rate, args.duration, args.adapters, seed).items():
                if args.traces and not trace_name.startswith(tuple(args.traces)):
                    continue
                for policies in [p for p in POLICY_SETS if not args.policies or p.name in args.policies]:
                    began = time.perf_counter()
                    build = simulator_factory(
                        policies, workers, calibration, model, batch_min_gap=args.batch_min_gap
                    )
                    result = build().run(trace)
                    summary = summarize(result, slo_s)
                    rows.append({"seed": seed, "workers": workers, "trace": trace_name,
                                 "policy": policies.name, "rate_rps": rate, **asdict(summary)})  # fmt: skip
                    print(f"s{seed} {workers:3d} {trace_name:32s} {policies.name:28s} "
                          f"p50 {summary.p50_latency_s:7.2f} p99 {summary.p99_latency_s:7.2f} "
                          f"slo {summary.slo_attainment:5.1%} thr {summary.throughput_rps:6.2f} "
                          f"mig/min {summary.migrations_per_min:7.1f} ({time.perf_counter() - began:.0f} s)",
                          flush=True)  # fmt: skip
                    # After every run: a long sweep cut short keeps what it measured.
                    (out / "results.json").write_text(
                        json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n"
                    )
    write_report(out, meta, rows)


if __name__ == "__main__":
    main()
