"""S-LoRA's adapter clustering on vs off (SEED-SPECS §5 "Reproducible here" 2): 32 adapters of
Zipf popularity in a tight pool; at most C distinct adapters per batch (C = ∞ is FCFS).
Throughput, mean latency and Jain's fairness over the adapters' mean latencies."""

from __future__ import annotations

from dataclasses import replace

from bench.policies.capacity import DTYPE
from bench.policies.harness import RunSetting, run_trace, summary, trace_seconds, window_s
from bench.policies.profiles import PolicyBenchProfile
from bench.policies.satisfaction import jain_index, per_adapter_mean_latency
from bench.policies.traces import zipf_gamma_trace
from bench.systems.engine_system import EngineSystem, EngineSystemOptions
from services.gpu_worker.engine.policies.adapter_clustering import AdapterClustering, AdapterClusteringConfig

UNCAPPED = "∞ (fcfs)"


def make_system(cap: int | None) -> EngineSystem:
    if cap is None:
        return EngineSystem(EngineSystemOptions(name=UNCAPPED, dtype=DTYPE))
    return EngineSystem(
        EngineSystemOptions(
            name=f"C={cap}",
            dtype=DTYPE,
            batch_policy=lambda: AdapterClustering(AdapterClusteringConfig(max_adapters=cap)),
        )
    )


def run(profile: PolicyBenchProfile, setting: RunSetting, capacity_rps: float, log) -> list[dict]:
    rate = profile.cluster_load * capacity_rps
    setting = replace(
        setting,
        window_s=window_s(profile.cluster_requests, rate, capacity_rps, profile.drain_s),
        max_batch=profile.cluster_max_batch,
        pool_mib=profile.cluster_pool_mib,
    )
    trace = zipf_gamma_trace(
        profile.cluster_adapters, profile.cluster_alpha, rate, 1.0, trace_seconds(profile.cluster_requests, rate),
        profile.input_range, profile.output_range, profile.seed,
    )  # fmt: skip
    rows = []
    for cap in (*profile.cluster_caps, None):
        system = make_system(cap)
        records = run_trace(system, trace, setting)
        per_adapter = per_adapter_mean_latency(records)
        row = {
            "cap": cap,
            "rate_rps": round(rate, 4),
            **summary(system, records, setting),
            "jain_fairness": round(jain_index(list(per_adapter.values())), 4),
            "adapters_served": len(per_adapter),
        }
        log(
            f"clustering {system.name}: {row['throughput_tps']} tok/s, avg latency {row['avg_latency_s']} s, Jain {row['jain_fairness']}"
        )
        rows.append(row)
    return rows
