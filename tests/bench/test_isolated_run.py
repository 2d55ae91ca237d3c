"""Each bench run starts in a fresh process with the torch thread settings it is given, whatever
the bench's own process or an earlier run set, and says how loaded the machine was; the report
quotes no ratio over a loaded run."""

from __future__ import annotations

from dataclasses import asdict

import torch

from bench.serving.isolated_run import RunThreads, loaded, run_isolated, thread_settings
from bench.serving.profiles import LORAMESH, PEFT, QUICK
from bench.serving.report import headline
from bench.serving.runner import machine_info


def test_a_run_gets_the_configured_threads_not_the_parent_s_nor_an_earlier_run_s(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the bench's environment reaches every run
    configured = RunThreads(intra_op=2, inter_op=1)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as a system run in the bench's own process could have left it
    try:
        earlier = run_isolated(torch.set_num_threads, (3,), configured)  # a run that changes them
        later = run_isolated(thread_settings, (), configured)
        assert torch.get_num_threads() == 1  # the parent's own setting is untouched
    finally:
        torch.set_num_threads(before)
    assert earlier["threads"] == later["threads"] == later["result"]
    assert later["result"] == {"intra_op": 2, "inter_op": 1, "omp_wait_policy": "PASSIVE"}
    load = later["load"]
    assert 0 <= load["others_cpu_share"] and load["load_1min_before"] >= 0 and load["load_1min_after"] >= 0


def _run(system: str, tps: float, others: float) -> dict:
    workload = asdict(QUICK.workload)
    workload["adapters"] = QUICK.comparison_adapters
    metrics = {"throughput_tps": tps, "throughput_rps": tps / 40, "avg_first_token_s": 1.0}
    return {
        "system": system,
        "workload": workload,
        "sweeps": ["comparison"],
        "metrics": metrics,
        "load": {"others_cpu_share": others},
    }


def _results(*runs: dict) -> dict:
    return {"profile": asdict(QUICK), "machine": machine_info(RunThreads(2, 2)), "runs": list(runs)}


def test_the_ratio_to_peft_is_quoted_only_when_neither_run_was_loaded():
    quiet = headline(_results(_run(LORAMESH, 120.0, 0.02), _run(PEFT, 30.0, 0.05)))
    assert "= **4.00×**" in quiet[0]
    busy = headline(_results(_run(LORAMESH, 120.0, 0.02), _run(PEFT, 3.0, 0.60)))
    assert "×" not in busy[0].split("tok/s = ", 1)[1] and "not quoted" in busy[0] and "60%" in busy[0]
    assert loaded(_run(PEFT, 3.0, 0.60)) and not loaded(_run(PEFT, 30.0, 0.05))
    assert not loaded({"system": PEFT})  # results recorded before runs measured the load
