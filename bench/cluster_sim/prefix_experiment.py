"""Prefix-aware placement against residency-only placement (least-estimated-wait: adapter
residency + load) on a prefix-sharing trace, at equal offered load: the same trace through both.

Each worker has a prefix cache (``--prefix-cache-tokens``); the scheduler side is the real code
(the policies, the :class:`~services.scheduler.cluster_view.ClusterView` and, for prefix-aware
placement, its :class:`~services.scheduler.prefix_index.PrefixIndex`). The load is set against
the cluster's estimated capacity without any cache hit (``--loads``), so both policies are
offered the same requests. Writes ``results.json`` (after every run) and ``results.md`` to ``--out``.

    .venv/bin/python -m bench.cluster_sim.prefix_experiment --workers 64 --out bench/out/prefix_placement
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.cluster_sim.cost_model import Calibration
from bench.cluster_sim.experiment import capacity_rps, wait_model
from bench.cluster_sim.prefix_traces import PrefixWorkload, prefix_trace
from bench.cluster_sim.simulator import ClusterSimulator, SimConfig, SimResult
from bench.cluster_sim.worker import WorkerSpec
from bench.out_dir import default_out
from bench.workload import WorkloadSpec
from services.scheduler.policies import make_placement
from services.scheduler.policies.prefix_aware import PrefixAwareConfig
from services.scheduler.prefix_index import PrefixIndexConfig

CALIBRATION = Path(__file__).parent / "calibrations" / "grid_quiet.json"
"""The quiet calibration: its attention term prices a cached prefix's context, which a hit keeps."""
OUTPUT_RANGE = (16, 128)
RANKS = (8, 16, 32, 64)


@dataclass(frozen=True)
class PrefixSummary:
    """One run's figures."""

    requests: int
    finished: int
    hit_rate: float
    """Prompt tokens found cached at a request's first start / all prompt tokens."""
    ttft_p50_s: float
    ttft_p99_s: float
    latency_p50_s: float
    latency_p99_s: float
    throughput_rps: float
    """Finished requests per second, first arrival to last completion."""
    busiest_worker_share: float
    """Requests placed on the busiest worker / requests per worker on average (1: even)."""


def summarize(result: SimResult) -> PrefixSummary:
    done = [r for r in result.requests if r.finish_s is not None]
    started = [r for r in result.requests if r.first_token_s is not None]
    ttft = np.array([r.first_token_s - r.arrival_s for r in started] or [np.nan])
    latency = np.array([r.finish_s - r.arrival_s for r in done] or [np.nan])
    prompt = sum(r.input_len for r in result.requests)
    cached = sum(r.first_cached_tokens or 0 for r in result.requests)
    start = min((r.arrival_s for r in result.requests), default=0.0)
    span = max((r.finish_s for r in done), default=start) - start
    per_worker: dict[str, int] = {}
    for r in result.requests:
        per_worker[r.worker] = per_worker.get(r.worker, 0) + 1
    mean = len(result.requests) / max(1, len(per_worker))
    return PrefixSummary(
        requests=len(result.requests),
        finished=len(done),
        hit_rate=cached / max(1, prompt),
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        latency_p50_s=float(np.percentile(latency, 50)),
        latency_p99_s=float(np.percentile(latency, 99)),
        throughput_rps=len(done) / max(span, 1e-9),
        busiest_worker_share=max(per_worker.values(), default=0) / max(mean, 1e-9),
    )


def policies(calibration: Calibration) -> dict[str, tuple[str, PrefixAwareConfig | None]]:
    """Name -> (placement policy, prefix-aware weights): the residency-only baseline, prefix-aware
    with the calibration's prefill cost per token and the default imbalance weight, and with
    none (the hit saving against the wait estimate alone)."""
    model = calibration.model
    prefill_ms = model["per_token_ms"] + model["per_rank_token_ms"] * sum(RANKS) / len(RANKS)
    default = PrefixAwareConfig()
    return {
        "residency-only (LEW)": ("least-estimated-wait", None),
        "prefix-aware": ("prefix-aware", PrefixAwareConfig(prefill_ms_per_token=prefill_ms)),
        "prefix-aware, no imbalance term": (
            "prefix-aware",
            PrefixAwareConfig(prefill_ms_per_token=prefill_ms, imbalance_ms_per_request=0.0),
        ),
        "prefix-aware, 4x imbalance": (
            "prefix-aware",
            PrefixAwareConfig(
                prefill_ms_per_token=prefill_ms, imbalance_ms_per_request=4 * default.imbalance_ms_per_request
            ),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", default=str(CALIBRATION))
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=512)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--prefixes-per-tenant", type=int, default=8)
    parser.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.8],
                        help="offered load / estimated capacity without cache hits")  # fmt: skip
    parser.add_argument("--duration", type=float, default=300.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--prefix-cache-tokens", type=int, default=16384, help="per worker")
    parser.add_argument("--index-blocks", type=int, default=1024,
                        help="the scheduler's prefix index per worker, in blocks")  # fmt: skip
    parser.add_argument("--policies", nargs="*", default=[], help="only these (by name)")
    parser.add_argument("--out", default=str(default_out("prefix_placement")))
    args = parser.parse_args()
    calibration = Calibration.load(args.calibration)
    spec = WorkerSpec(max_running=32, memory_tokens=32768, adapter_tokens_per_rank=10,
                      adapter_load_ms=calibration.adapter_load_ms,
                      prefix_cache_tokens=args.prefix_cache_tokens)  # fmt: skip
    base = PrefixWorkload(WorkloadSpec(), tenants=args.tenants, prefixes_per_tenant=args.prefixes_per_tenant)
    prompt_range = (base.prefix_range[0] + base.suffix_range[0], base.prefix_range[1] + base.suffix_range[1])
    per_worker = capacity_rps(calibration.model, spec, prompt_range, OUTPUT_RANGE, RANKS)
    model = wait_model(calibration, OUTPUT_RANGE, spec.max_running, RANKS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"cpu_model": calibration.cpu_model, "calibration": Path(args.calibration).name,
            "capacity_rps_per_worker": per_worker, "workers": args.workers, "adapters": args.adapters,
            "tenants": args.tenants, "prefixes_per_tenant": args.prefixes_per_tenant,
            "duration_s": args.duration, "prefix_cache_tokens": args.prefix_cache_tokens,
            "index_blocks": args.index_blocks, "seeds": args.seeds}  # fmt: skip
    rows = []
    chosen = {k: v for k, v in policies(calibration).items() if not args.policies or k in args.policies}
    for seed in args.seeds:
        for load in args.loads:
            rate = load * per_worker * args.workers
            arrivals = WorkloadSpec(adapters=args.adapters, alpha=1.0, rate=rate, cv=1.0,
                                    output_range=OUTPUT_RANGE, ranks=RANKS, duration_s=args.duration,
                                    seed=seed)  # fmt: skip
            trace = prefix_trace(replace_arrivals(base, arrivals))
            for name, (placement, weights) in chosen.items():
                began = time.perf_counter()
                config = SimConfig(workers=args.workers, worker=spec,
                                   prefix_index=PrefixIndexConfig(max_blocks_per_worker=args.index_blocks))  # fmt: skip
                result = ClusterSimulator(
                    config, calibration.model, make_placement(placement, model, weights)
                ).run(trace)
                summary = summarize(result)
                rows.append({"seed": seed, "load": load, "rate_rps": rate, "policy": name, **asdict(summary)})
                print(f"s{seed} load {load:.2f} {name:34s} hit {summary.hit_rate:6.1%} "
                      f"ttft p50 {summary.ttft_p50_s:6.2f} p99 {summary.ttft_p99_s:6.2f} "
                      f"e2e p50 {summary.latency_p50_s:6.2f} p99 {summary.latency_p99_s:6.2f} "
                      f"thr {summary.throughput_rps:6.2f} busiest {summary.busiest_worker_share:4.2f} "
                      f"({time.perf_counter() - began:.0f} s)", flush=True)  # fmt: skip
                (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / "results.md").write_text(table(meta, rows))


def replace_arrivals(workload: PrefixWorkload, arrivals: WorkloadSpec) -> PrefixWorkload:
    return PrefixWorkload(**{**vars(workload), "arrivals": arrivals})


def table(meta: dict, rows: list[dict]) -> str:
    lines = [
        (
            f"{meta['workers']} simulated workers, {meta['adapters']} adapters of {meta['tenants']} tenants, "
            f"{meta['tenants'] * meta['prefixes_per_tenant']} shared prompts, prefix cache "
            f"{meta['prefix_cache_tokens']} tokens a worker, calibration {meta['calibration']} "
            f"({meta['cpu_model']}), {meta['duration_s']:.0f} s, seeds {meta['seeds']}"
        ),
        "",
        (
            "| seed | load | policy | hit rate | TTFT p50 (s) | TTFT p99 (s) | e2e p50 (s) | e2e p99 (s) "
            "| throughput (req/s) | busiest worker / mean |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['load']:.2f} | {r['policy']} | {r['hit_rate']:.1%} | {r['ttft_p50_s']:.2f} "
            f"| {r['ttft_p99_s']:.2f} | {r['latency_p50_s']:.2f} | {r['latency_p99_s']:.2f} "
            f"| {r['throughput_rps']:.2f} | {r['busiest_worker_share']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
