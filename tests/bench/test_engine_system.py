"""The in-process loramesh system and its ablations replay a trace on the real model, and the
report turns the results into markdown and plots."""

from __future__ import annotations

import json
import math

import pytest

from bench.serving import report
from bench.serving.adapters import ensure_adapter_set, evict_from_page_cache
from bench.serving.metrics import summarize
from bench.serving.profiles import QUICK
from bench.systems.base import RunContext
from bench.systems.engine_system import EngineSystem, EngineSystemOptions
from bench.workload import WorkloadSpec, generate
from services.model_files.base_model import load_base_model_spec

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-adapters")
    return ensure_adapter_set(root, load_base_model_spec(), 6, (8, 16))


def test_adapter_set_is_reused_and_grows_as_a_prefix(adapters):
    again = ensure_adapter_set(adapters.root, load_base_model_spec(), 4, (8, 16))
    assert again.ranks == (8, 16, 8, 16) and again.directory(3) == adapters.directory(3)
    evict_from_page_cache(adapters)  # needs no privileges


@pytest.mark.parametrize(
    "options",
    [
        EngineSystemOptions(),
        EngineSystemOptions(name="bmm", lora_backend="padded_bmm"),
        EngineSystemOptions(name="split", adapter_region_share=0.5),
    ],
    ids=lambda o: o.name,
)
def test_every_request_completes_with_its_tokens_and_disk_reads_respect_the_budget(adapters, options):
    trace = generate(WorkloadSpec(adapters=6, rate=4, duration_s=1.5, input_range=(4, 12), output_range=(2, 5),
                                  ranks=(8, 16), seed=3))  # fmt: skip
    samples, progress = [], []
    one_adapter_mib = 1.0  # a rank-8/16 q/k/v/o adapter of SmolLM2 in fp32 is 1.8–3.7 MiB
    context = RunContext(
        trace=trace, adapters=adapters, window_s=math.inf, pool_mib=64, host_cache_mib=one_adapter_mib,
        on_progress=progress.append, on_sample=lambda t, s: samples.append(s),
    )  # fmt: skip
    system = EngineSystem(options)
    records = system.run(context)
    assert [r.request_id for r in records] == [t.request_id for t in trace]
    assert all(r.completed and r.output_tokens == r.output_len for r in records)
    assert all(r.arrival_s <= r.first_token_s <= r.finish_s for r in records)
    assert sum(progress) == len(trace) and samples
    # A budget below one adapter keeps no idle host copy: each reuse after a drop re-reads it.
    assert system.stats()["adapter_fetches"] >= len({r.adapter for r in trace})
    metrics = summarize(records, 60, 6.0)
    assert metrics.completed == len(trace) and metrics.slo_attainment > 0


def test_report_writes_markdown_with_the_headline_and_plots(tmp_path):
    def run(system, n, rate, rps, sweeps):
        return {
            "system": system, "key": f"{system} {n}", "sweeps": sweeps,
            "workload": {"adapters": n, "rate": rate, "cv": 1.0},
            "metrics": {"requests": 10, "completed": 10, "throughput_rps": rps, "throughput_tps": 10 * rps,
                        "avg_latency_s": 1.0, "p99_latency_s": 2.0, "avg_first_token_s": 0.5 / rps,
                        "slo_attainment": 0.9, "user_satisfaction": 0.7},
            "pool_samples": [{"t": 0.0, "kv_pages": 1, "adapter_pages": 2, "free_pages": 7, "total_pages": 10,
                              "running": 1}],
        }  # fmt: skip

    profile = json.loads(json.dumps(QUICK.__dict__, default=lambda o: o.__dict__))
    rate = QUICK.workload.rate
    results = {
        "profile": profile, "model": "m", "started": "now",
        "machine": {"cpu": "cpu", "cpus": 2, "torch": "2", "torch_threads": 2},
        "runs": [run("loramesh", 100, rate, 4.0, ["adapters", "comparison"]), run("loramesh", 2000, rate, 3.8, ["adapters"]),
                 run("peft", 100, rate, 0.5, ["adapters", "comparison"]), run("loramesh", 100, rate / 2, 3.0, ["rate"])],
    }  # fmt: skip
    report.write(results, tmp_path)
    text = (tmp_path / "results.md").read_text()
    assert "**8.00×**" in text and "**0.95×**" in text
    for name in ("throughput_vs_adapters", "first_token_vs_rate", "pool_occupancy"):
        assert (tmp_path / report.PLOTS[name]).stat().st_size > 10_000


def test_a_configured_batch_policy_runs_and_its_decisions_come_back(adapters):
    from services.gpu_worker.engine.policies.dlora import DloraConfig, DynamicBatching

    trace = generate(WorkloadSpec(adapters=2, alpha=3, rate=4, duration_s=1.0, input_range=(4, 8), output_range=(2, 4),
                                  ranks=(8, 16), seed=5))  # fmt: skip
    context = RunContext(trace=trace, adapters=adapters, window_s=math.inf, pool_mib=64)
    system = EngineSystem(
        EngineSystemOptions(
            name="dlora",
            # Algorithm 1 as published: the merge gate would make switching depend on measured step times.
            batch_policy=lambda: DynamicBatching(DloraConfig(alpha=0.1, beta=0.05, merge_must_pay=False)),
        )
    )
    records = system.run(context)
    assert all(r.completed and r.output_tokens == r.output_len for r in records)
    stats = system.stats()
    assert stats["lora_mode_switches"] >= 1 and stats["batch_policy_mode_switches"] >= 1


def test_requests_an_early_abort_gives_up_on_are_recorded_as_aborted(adapters):
    from services.gpu_worker.engine.policies.early_abort import EarlyAbort, EarlyAbortConfig

    trace = generate(WorkloadSpec(adapters=2, rate=4, duration_s=1.0, input_range=(4, 8), output_range=(2, 4),
                                  ranks=(8, 16), seed=6))  # fmt: skip
    context = RunContext(trace=trace, adapters=adapters, window_s=math.inf, pool_mib=64)
    # No first token can come within a microsecond: every request is aborted before it runs.
    system = EngineSystem(
        EngineSystemOptions(
            name="abort", batch_policy=lambda: EarlyAbort(EarlyAbortConfig(first_token_slo_s=1e-6))
        )
    )
    records = system.run(context)
    assert records and all(r.error == "aborted" and r.first_token_s is None for r in records)
    assert system.stats()["aborted_requests"] == len(trace)
