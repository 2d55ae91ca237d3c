"""S-LoRA's early abort vs FCFS vs LCFS (seed 000 Appendix B; SEED-SPECS §5 "Reproducible here"
1): gamma arrivals above capacity at several coefficients of variation, a first-token SLO a
multiple of the low-load median first-token latency; SLO attainment and user satisfaction in the
linear and the quadratic form."""

from __future__ import annotations

from dataclasses import replace

from bench.policies.capacity import DTYPE
from bench.policies.harness import RunSetting, run_trace, summary, trace_seconds, window_s
from bench.policies.profiles import PolicyBenchProfile
from bench.policies.satisfaction import first_token_scores
from bench.policies.traces import zipf_gamma_trace
from bench.systems.engine_system import EngineSystem, EngineSystemOptions
from services.gpu_worker.engine.policies.early_abort import EarlyAbort, EarlyAbortConfig
from services.gpu_worker.engine.policies.lcfs import Lcfs

POLICIES = ("early_abort", "fcfs", "lcfs")


def make_system(name: str, slo_s: float) -> EngineSystem:
    factories = {
        "early_abort": lambda: EarlyAbort(EarlyAbortConfig(first_token_slo_s=slo_s)),
        "fcfs": None,
        "lcfs": Lcfs,
    }
    return EngineSystem(EngineSystemOptions(name=name, dtype=DTYPE, batch_policy=factories[name]))


def run(
    profile: PolicyBenchProfile, setting: RunSetting, capacity_rps: float, slo_s: float, log
) -> list[dict]:
    rate = profile.abort_load * capacity_rps
    setting = replace(
        setting,
        window_s=window_s(profile.abort_requests, rate, capacity_rps, profile.drain_s),
        max_batch=profile.max_batch,
        slo_s=slo_s,
    )
    rows = []
    for cv in profile.abort_cvs:
        trace = zipf_gamma_trace(
            profile.abort_adapters, 1.0, rate, cv, trace_seconds(profile.abort_requests, rate),
            profile.input_range, profile.output_range, profile.seed,
        )  # fmt: skip
        for name in POLICIES:
            system = make_system(name, slo_s)
            records = run_trace(system, trace, setting)
            scores = first_token_scores(records, slo_s)
            row = {
                "cv": cv,
                "rate_rps": round(rate, 4),
                **summary(system, records, setting),
                **scores.to_dict(),
            }
            log(
                f"abort cv {cv:g} {name}: attainment {scores.attainment:.3f}, quadratic {scores.quadratic_satisfaction:.3f}, {len(trace)} requests"
            )
            rows.append(row)
    return rows
