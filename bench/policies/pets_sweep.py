"""PetS coordinated batching vs greedy FCFS prefill (SEED-SPECS §4 "Reproducible here" 2): a
queue of prompts of many tasks (adapters), lengths ~ N(mean, σ), one output token each, all
queued at once; the time to prefill the whole queue and the prompts per second it gives."""

from __future__ import annotations

from dataclasses import replace

from bench.policies.capacity import DTYPE
from bench.policies.harness import RunSetting, run_trace, summary
from bench.policies.profiles import PolicyBenchProfile
from bench.policies.traces import prefill_queue
from bench.systems.engine_system import EngineSystem, EngineSystemOptions
from services.gpu_worker.engine.policies.pets_prefill import PetsPrefill

POLICIES = ("pets", "fcfs")


def make_system(name: str) -> EngineSystem:
    factory = PetsPrefill if name == "pets" else None
    return EngineSystem(EngineSystemOptions(name=name, dtype=DTYPE, batch_policy=factory))


def run(profile: PolicyBenchProfile, setting: RunSetting, log) -> list[dict]:
    setting = replace(setting, window_s=120.0 + profile.drain_s, max_batch=profile.pets_max_batch)
    rows = []
    for sigma in profile.pets_sigmas:
        trace = prefill_queue(
            profile.pets_tasks, profile.pets_prompts, profile.pets_mean_len, sigma, profile.seed
        )
        for name in POLICIES:
            system = make_system(name)
            records = run_trace(system, trace, setting)
            finished = [r.finish_s for r in records if r.completed]
            makespan = max(finished) if len(finished) == len(records) else None
            row = {
                "sigma": sigma,
                "prompt_tokens": sum(r.input_len for r in trace),
                **summary(system, records, setting),
                "prefill_queue_s": round(makespan, 4) if makespan else None,
                "prompts_per_s": round(len(records) / makespan, 3) if makespan else None,
            }
            log(f"pets σ={sigma:g} {name}: queue prefilled in {row['prefill_queue_s']} s")
            rows.append(row)
    return rows
