"""The report's tables and plot from a results dict shaped like experiment.py's."""

from __future__ import annotations

from bench.distkv.report import batch_table, context_table, overhead_table, render, write_report


def summary(completed: int, long_completed: int, refused: int, served: float, wall: float = 10.0) -> dict:
    latency = {"p50": 1.0, "p90": 2.0, "max": 3.0}
    return {
        "requests": completed + refused, "long_requests": long_completed + refused,
        "completed": completed, "refused": refused, "failed": 0, "stuck": 0,
        "long_completed": long_completed, "long_refused": refused, "long_failed": 0, "long_stuck": 0,
        "wall_s": wall, "output_tokens": 8 * completed, "output_tokens_per_s": 8 * completed / wall,
        "served_tokens_per_s": served, "latency_s": latency, "short_latency_s": latency,
        "long_latency_s": latency if long_completed else {"p50": None, "p90": None, "max": None},
        "mean_decode_step_ms": 200.0, "preemptions": 0,
    }  # fmt: skip


def traffic(kv: int) -> dict:
    return {
        "sent": 100,
        "received": 50,
        "kv_bytes": kv,
        "moved": 150,
        "kv_over_moved": kv / 150,
        "context_tokens": 9,
    }


RESULTS = {
    "profile": "full",
    "commit": "abc1234",
    "started": "2026-11-23 19:00:00 UTC",
    "elapsed_s": 600.0,
    "machine": {"cpu": "AMD EPYC", "cores": 2, "avx2": True, "avx512_bf16": False},
    "load_average": {"before": [1.0, 1.0, 1.0], "after": [2.0, 2.0, 2.0]},
    "longest_context": {
        "alone": {"longest_served": 1024, "shortest_refused": 1026, "bound": 1026, "goal": None, "pool_tokens": 1024,
                  "probes": [{"context_tokens": 512, "served": True}, {"context_tokens": 1024, "served": True}]},
        "borrow": {"longest_served": 2688, "shortest_refused": 2818, "bound": 2818, "goal": 2560, "pool_tokens": 1024,
                   "probes": [{"context_tokens": 2560, "served": True}, {"context_tokens": 2688, "served": True}]},
    },
    "workloads": {
        "borrow": {"0.5": {"summary": summary(20, 10, 0, 90.0)}, "0.01": {"summary": summary(20, 1, 0, 80.0)}},
        "alone": {"0.5": {"summary": summary(10, 0, 10, 40.0)}, "0.01": {"summary": summary(19, 0, 1, 85.0)}},
    },
    "same_batch": {"borrow": {"summary": summary(4, 1, 0, 50.0)}, "all-local": {"summary": summary(4, 1, 0, 100.0)}},
    "decode_overhead": {
        "borrow": {"outcome": {"first_token_s": 30.0}, "decode_step_ms": 900.0, "borrowed_blocks": {"w1": 10, "w2": 8},
                   "analytic_traffic_per_step": traffic(18 * 737280), "counters_per_step": None},
        "all-local": {"outcome": {"first_token_s": 9.0}, "decode_step_ms": 180.0, "borrowed_blocks": {},
                      "analytic_traffic_per_step": traffic(0), "counters_per_step": None},
    },
}  # fmt: skip


def test_context_table_gives_the_ratio_to_one_worker_alone_and_marks_an_unprobed_bound():
    table = context_table(RESULTS)
    assert "| alone | 1,024 | 1,024 | 1,026 (capacity bound) |" in table
    assert "| borrow | 1,024 | 2,688 |" in table and "2.62×" in table
    assert "2560: yes, 2688: yes" in table


def test_workload_rows_come_in_long_share_order_borrow_first():
    lines = render(RESULTS).splitlines()
    rows = [line for line in lines if line.startswith(("| 1%", "| 50%"))]
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| 1%", "borrow"], ["| 1%", "alone"], ["| 50%", "borrow"], ["| 50%", "alone"]
    ]  # fmt: skip
    assert "| 50% | alone | 20 (10) | 10 (0) | 10 (10) | 0 | 40.0 |" in rows[3]


def test_batch_table_compares_with_all_local():
    table = batch_table(RESULTS)
    assert "| borrow | 4 | 4 | 10.0 | 50.0 | 3.20 | 0.50× |" in table
    assert "| all-local | 4 | 4 | 10.0 | 100.0 | 3.20 | 1.00× |" in table


def test_overhead_table_says_when_counters_are_not_reported():
    table = overhead_table(RESULTS)
    assert "| borrow | 900.0 | 30.0 | 10, 8 | not reported | not reported | 150 | 13,271,040 |" in table
    assert "| all-local | 180.0 | 9.0 | none | – | – |" in table


def test_write_report_writes_markdown_and_a_png(tmp_path):
    write_report(RESULTS, tmp_path)
    assert (
        (tmp_path / "results.md").read_text().startswith("# DistKV-LLM long-context benchmark (full profile)")
    )
    assert (tmp_path / "distkv.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
