"""Preemption victim ablation: ``newest`` (vLLM's and S-LoRA's choice, the engine's default) vs
``fewest_computed`` (the request whose recompute is cheapest), under a pool small enough that
decodes outgrow it. Poisson arrivals above capacity; the recompute each policy causes shows in
the preemption count and in the latency of the requests it sends back to the queue."""

from __future__ import annotations

from dataclasses import replace

from bench.policies.capacity import DTYPE
from bench.policies.harness import RunSetting, run_trace, summary, trace_seconds, window_s
from bench.policies.profiles import PolicyBenchProfile
from bench.policies.traces import zipf_gamma_trace
from bench.systems.engine_system import EngineSystem, EngineSystemOptions
from services.gpu_worker.engine.policies.preemption import PREEMPTION_POLICIES

TIGHT_POOL_MIB = 8.0
"""A pool (fp32 SmolLM2) that holds one rank-8 adapter and a few requests' KV: decodes force preemptions."""
ADAPTERS = 1
"""One adapter, so the pool's room goes to KV and many requests run (and grow) together; with
the profile's 8 distinct adapters a tight pool runs one request at a time and never preempts."""


def make_system(name: str) -> EngineSystem:
    return EngineSystem(EngineSystemOptions(name=name, dtype=DTYPE, preemption_policy=name))


def run(profile: PolicyBenchProfile, setting: RunSetting, capacity_rps: float, log) -> list[dict]:
    rate = profile.abort_load * capacity_rps
    setting = replace(
        setting,
        window_s=window_s(profile.abort_requests, rate, capacity_rps, profile.drain_s),
        max_batch=profile.max_batch,
        pool_mib=TIGHT_POOL_MIB,
    )
    trace = zipf_gamma_trace(
        ADAPTERS, 1.0, rate, 1.0, trace_seconds(profile.abort_requests, rate),
        profile.input_range, profile.skew_output_range, profile.seed,
    )  # fmt: skip
    rows = []
    for name in sorted(PREEMPTION_POLICIES):
        system = make_system(name)
        records = run_trace(system, trace, setting)
        row = {"rate_rps": round(rate, 4), **summary(system, records, setting)}
        log(f"preemption {name}: {row['system_stats'].get('preemptions')} preemptions, {len(trace)} requests")
        rows.append(row)
    return rows
