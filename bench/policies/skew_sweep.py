"""dLoRA's skewness sweep (seed 001 §7; SEED-SPECS §2 "Reproducible here" 1): 8 rank-8 adapters,
the top adapter's share of requests from uniform to 90%, Poisson arrivals at a share of the
measured capacity. Dynamic (``dlora``) vs merged-only (:mod:`bench.systems.merged_swap`, one
adapter merged at a time) vs unmerged-only (``fcfs``); the metric is the average latency."""

from __future__ import annotations

from dataclasses import replace

from bench.policies.capacity import DTYPE
from bench.policies.harness import RunSetting, run_trace, summary, trace_seconds, window_s
from bench.policies.profiles import PolicyBenchProfile
from bench.policies.traces import skewed_trace
from bench.systems.engine_system import EngineSystem, EngineSystemOptions
from bench.systems.merged_swap import MergedSwapSystem
from services.gpu_worker.engine.policies.dlora import DynamicBatching

DYNAMIC, MERGED_ONLY, UNMERGED_ONLY = "dynamic (dlora)", "merged-only", "unmerged-only (fcfs)"
SYSTEMS = (DYNAMIC, MERGED_ONLY, UNMERGED_ONLY)


def make_system(name: str):
    if name == DYNAMIC:
        return EngineSystem(EngineSystemOptions(name=DYNAMIC, dtype=DTYPE, batch_policy=DynamicBatching))
    if name == MERGED_ONLY:
        return MergedSwapSystem()
    if name == UNMERGED_ONLY:
        return EngineSystem(EngineSystemOptions(name=UNMERGED_ONLY, dtype=DTYPE))
    raise ValueError(f"unknown system {name!r}")


def run(profile: PolicyBenchProfile, setting: RunSetting, capacity_rps: float, log) -> list[dict]:
    # Capacity was measured with the suite's output lengths; decode steps dominate, so requests
    # with longer outputs are served at about the lengths' ratio fewer per second.
    capacity_rps *= _mean(profile.output_range) / _mean(profile.skew_output_range)
    rate = profile.skew_load * capacity_rps
    setting = replace(
        setting,
        window_s=window_s(profile.skew_requests, rate, capacity_rps, profile.drain_s),
        max_batch=profile.max_batch,
    )
    rows = []
    for share in profile.skew_top_shares:
        trace = skewed_trace(
            profile.skew_adapters, share, rate, trace_seconds(profile.skew_requests, rate),
            profile.input_range, profile.skew_output_range, profile.seed,
        )  # fmt: skip
        for name in SYSTEMS:
            system = make_system(name)
            row = {
                "top_share": share,
                "rate_rps": round(rate, 4),
                **summary(system, run_trace(system, trace, setting), setting),
            }
            row["system"] = name
            log(
                f"skew {share:.3f} {name}: avg latency {row['avg_latency_s']} s, {row['completed']}/{row['requests']} done"
            )
            rows.append(row)
    return rows


def _mean(bounds: tuple[int, int]) -> float:
    return (bounds[0] + bounds[1]) / 2
