"""bench/deterministic_bench.py's arithmetic and report, without running an engine."""

from __future__ import annotations

from bench.deterministic_bench import CPU_FLAGS, cpu_flags, quiet_median, report


def test_medians_leave_out_busy_steps_when_enough_are_quiet():
    assert quiet_median([(1.0, 0.0), (9.0, 0.5), (3.0, 0.05)]) == (2.0, 2)
    # Fewer than half quiet: every step counts.
    assert quiet_median([(1.0, 0.0), (9.0, 0.5), (5.0, 0.9)]) == (5.0, 3)


def test_the_report_names_the_machine_and_the_ratios():
    row = {
        "dtype": "bfloat16",
        "compute_dtype": "torch.float32",
        "batch": 8,
        "default": {"prefill_tok_s": 400.0, "decode_tok_s": 40.0},
        "deterministic": {"prefill_tok_s": 360.0, "decode_tok_s": 80.0},
        "prefill_ratio": 0.9,
        "decode_ratio": 2.0,
    }
    result = {
        "machine": {"cpu": "AMD EPYC", "logical_cpus": 2, "cpu_flags": ["avx2", "fma"], "torch_threads": 2},
        "prompt_len": 64,
        "decode_steps": 12,
        "rounds": 3,
        "others_cpu_share": 0.01,
        "rows": [row],
        "geomean_ratio": 1.34,
        "worst_ratio": 0.9,
    }
    text = report(result)
    assert "AMD EPYC" in text and "flags avx2 fma" in text
    assert "| bfloat16 (float32) | 8 | 400.0 | 360.0 | 0.90 | 40.0 | 80.0 | 2.00 |" in text
    assert set(cpu_flags()) <= set(CPU_FLAGS)
