"""The suite's markdown tables and plots, from a hand-made results dict."""

from __future__ import annotations

from bench.policies import plots, tables


def skew_row(share, system, latency):
    return {"top_share": share, "system": system, "avg_latency_s": latency}


SKEW = [
    skew_row(0.125, "dynamic (dlora)", 2.0),
    skew_row(0.125, "merged-only", 5.0),
    skew_row(0.125, "unmerged-only (fcfs)", 2.5),
    skew_row(0.9, "dynamic (dlora)", 3.0),
    skew_row(0.9, "merged-only", 2.4),
    skew_row(0.9, "unmerged-only (fcfs)", None),
]


def abort_row(cv, system, attainment):
    return {
        "cv": cv, "system": system, "requests": 10, "aborted": 2 if system == "early_abort" else 0,
        "attainment": attainment, "linear_satisfaction": attainment / 2,
        "quadratic_satisfaction": attainment * 0.7, "avg_first_token_s": 1.5,
    }  # fmt: skip


ABORT = [
    abort_row(1.0, "early_abort", 0.6),
    abort_row(1.0, "fcfs", 0.2),
    abort_row(1.0, "lcfs", 0.5),
    abort_row(4.0, "early_abort", 0.3),
    abort_row(4.0, "fcfs", 0.0),
    abort_row(4.0, "lcfs", 0.3),
]


def test_skew_table_says_whether_dynamic_beat_the_better_baseline():
    table = tables.skew_table(SKEW).splitlines()
    assert table[0].startswith("| top share | dynamic (dlora) avg latency (s) | merged-only")
    assert "| 0.125 | 2.00 | 5.00 | 2.50 | yes (0.80×) |" in table
    # a baseline without a latency (nothing completed) gives no verdict
    assert "| 0.900 | 3.00 | 2.40 | – | – |" in table


def test_skew_verdict_no_when_a_baseline_is_faster():
    rows = [skew_row(0.5, "dynamic (dlora)", 3.0), skew_row(0.5, "merged-only", 2.4),
            skew_row(0.5, "unmerged-only (fcfs)", 2.6)]  # fmt: skip
    assert "no (1.25×)" in tables.skew_table(rows)


def test_abort_ratios_against_fcfs_and_lcfs():
    table = tables.abort_ratios(ABORT)
    assert "| 1 | 3.00× | 1.20× |" in table
    assert "| 4 | ∞ | 1.00× |" in table


def test_abort_table_lists_every_policy_and_both_satisfaction_forms():
    table = tables.abort_table(ABORT)
    assert "satisfaction (linear) | satisfaction (quadratic)" in table
    assert "| 1 | early_abort | 10 | 2 | 0.600 | 0.300 | 0.420 | 1.50 |" in table
    assert len(table.splitlines()) == 2 + len(ABORT)


def test_report_and_plots_from_results(tmp_path):
    clustering = [
        {"system": s, "throughput_tps": 10.0 + i, "throughput_rps": 0.5, "avg_latency_s": 3.0 - i,
         "p99_latency_s": 6.0, "jain_fairness": 0.9, "completed": 9, "requests": 10}
        for i, s in enumerate(["C=1", "∞ (fcfs)"])
    ]  # fmt: skip
    pets = [
        {"sigma": 4.0, "system": s, "requests": 48, "prompt_tokens": 1536, "prefill_queue_s": q, "prompts_per_s": 48 / q}
        for s, q in (("pets", 4.0), ("fcfs", 3.0))
    ]  # fmt: skip
    results = {
        "profile": {"name": "test"},
        "calibration": {"capacity_rps": 1.0, "low_load_median_first_token_s": 0.1, "slo_s": 1.0},
        "loadavg": [1.0, 1.0, 1.0],
        "lora_cost": {
            "batch": 8,
            "decode_step_s": {"base": 0.1, "one_adapter": 0.11, "distinct_adapters": 0.12},
            "bax_over_wx_one_adapter": 0.1,
            "bax_over_wx_distinct_adapters": 0.2,
            "merge_unmerge_s": 0.02,
        },
        "skew": SKEW,
        "abort": ABORT,
        "clustering": clustering,
        "pets": pets,
    }
    report = tables.report(results)
    for title in (
        "LoRA cost",
        "dLoRA skew sweep",
        "S-LoRA early abort",
        "Adapter clustering",
        "PetS prefill",
    ):
        assert f"## {title}" in report
    assert "| BAx/Wx, 8 adapters | 20.0% |" in report
    assert "| 4 | pets | 48 | 1536 | 4.00 | 12.0 |" in report
    written = plots.write(results, tmp_path)
    assert sorted(p.name for p in written) == [
        "abort_slo.png",
        "clustering.png",
        "pets_prefill.png",
        "skew_latency.png",
    ]
    assert all(p.stat().st_size > 1000 for p in written)
