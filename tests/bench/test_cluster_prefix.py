"""The cluster simulator's prefix cache and prefix-aware placement: a hit skips its prefill, and
on a prefix-sharing trace the scheduler's real prefix-aware policy finds more cached tokens than
residency-only placement (least-estimated-wait) on the same requests.

Cost model: every step costs 10 ms plus 1 ms per computed token; adapters load in 100 ms.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.cluster_sim.cost_model import SHAPE_TERMS
from bench.cluster_sim.prefix_experiment import summarize
from bench.cluster_sim.prefix_traces import PrefixWorkload, prefix_trace
from bench.cluster_sim.simulator import ClusterSimulator, PromptTraceRequest, SimConfig
from bench.cluster_sim.worker import WorkerSpec
from bench.workload import WorkloadSpec
from services.gpu_worker.engine.policies.linear_cost import LinearCost
from services.runtime.prefix_keys import prompt_block_keys
from services.scheduler.placement import WaitModel
from services.scheduler.policies import make_placement
from services.scheduler.policies.least_estimated_wait import LeastEstimatedWait
from services.scheduler.policies.prefix_aware import PrefixAwareConfig

COST = LinearCost.named(SHAPE_TERMS, base_ms=10.0, per_token_ms=1.0)
SPEC = WorkerSpec(max_running=8, memory_tokens=20_000, adapter_load_ms=100.0, prefix_cache_tokens=4096)
MODEL = WaitModel(adapter_load_ms=100.0, mean_output_tokens=4, max_running_hint=8, per_request_step_ms=1.0)


def test_a_cached_prefix_skips_its_prefill_on_the_worker_that_holds_it():
    prompt = list(range(1000, 1100))  # 6 whole blocks and 4 tokens
    keys = tuple(prompt_block_keys("tenant:t", prompt, 16))
    trace = [PromptTraceRequest(t, 0, 8, 100, 2, f"r{t}", prefix_blocks=keys) for t in (0.0, 1.0)]
    sim = ClusterSimulator(SimConfig(workers=1, worker=SPEC), COST, LeastEstimatedWait(MODEL))
    first, second = sim.run(trace).requests
    assert (first.first_cached_tokens, second.first_cached_tokens) == (0, 96)
    # Its prefill step computes 4 tokens instead of 100: 10 + 4 ms (the adapter is loaded).
    assert second.first_token_s - second.arrival_s == pytest.approx(0.014)
    assert first.first_token_s - first.arrival_s == pytest.approx(0.1 + 0.110)


def test_prefix_aware_placement_finds_more_cached_prompt_than_residency_only_on_one_trace():
    arrivals = WorkloadSpec(adapters=32, rate=20.0, output_range=(2, 8), duration_s=20.0, seed=3)
    workload = PrefixWorkload(arrivals, tenants=2, prefixes_per_tenant=6, prefix_range=(128, 256),
                              suffix_range=(8, 32))  # fmt: skip
    trace = prefix_trace(workload)
    results = {}
    for name, weights in (("least-estimated-wait", None), ("prefix-aware", PrefixAwareConfig())):
        small = replace(SPEC, prefix_cache_tokens=768)  # 3-6 shared prompts a worker, of 12
        sim = ClusterSimulator(SimConfig(workers=6, worker=small), COST, make_placement(name, MODEL, weights))
        results[name] = summarize(sim.run(trace))
        assert sim.view.prefix_index is None or sim.view.prefix_index.size() > 0
    assert results["prefix-aware"].requests == results["least-estimated-wait"].requests == len(trace)
    assert results["prefix-aware"].hit_rate > 1.3 * results["least-estimated-wait"].hit_rate
