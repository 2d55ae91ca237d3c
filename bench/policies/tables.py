"""Markdown tables of the suite's results (the same ones bench/HISTORY.md shows)."""

from __future__ import annotations


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _pivot(rows: list[dict], key: str, systems: list[str], metric: str, digits: int) -> list[list[str]]:
    points = sorted({r[key] for r in rows})
    table = []
    for point in points:
        cells = {r["system"]: r.get(metric) for r in rows if r[key] == point}
        table.append([_fmt(point, 3), *(_fmt(cells.get(s), digits) for s in systems)])
    return table


def systems_of(rows: list[dict]) -> list[str]:
    """System names in order of first appearance."""
    return list(dict.fromkeys(r["system"] for r in rows))


def skew_table(rows: list[dict]) -> str:
    """Average latency per top-adapter share and system, plus whether dynamic was the best."""
    systems = systems_of(rows)
    table = _pivot(rows, "top_share", systems, "avg_latency_s", 2)
    for line, point in zip(table, sorted({r["top_share"] for r in rows})):
        latency = {r["system"]: r["avg_latency_s"] for r in rows if r["top_share"] == point}
        line.append(_dynamic_verdict(latency, systems))
    return _table(
        ["top share", *(f"{s} avg latency (s)" for s in systems), "dynamic ≤ better of the two"], table
    )


def _dynamic_verdict(latency: dict, systems: list[str]) -> str:
    dynamic, *others = systems
    if latency.get(dynamic) is None or any(latency.get(o) is None for o in others):
        return "–"
    best = min(latency[o] for o in others)
    return f"{'yes' if latency[dynamic] <= best else 'no'} ({latency[dynamic] / best:.2f}×)"


def abort_table(rows: list[dict]) -> str:
    body = [
        [
            _fmt(r["cv"], 0), r["system"], str(r["requests"]), str(r["aborted"]), _fmt(r["attainment"], 3),
            _fmt(r["linear_satisfaction"], 3), _fmt(r["quadratic_satisfaction"], 3),
            _fmt(r["avg_first_token_s"], 2),
        ]
        for r in rows
    ]  # fmt: skip
    return _table(
        ["cv", "policy", "requests", "aborted", "SLO attainment", "satisfaction (linear)",
         "satisfaction (quadratic)", "avg first token (s)"],
        body,
    )  # fmt: skip


def abort_ratios(rows: list[dict]) -> str:
    """Abort's attainment over FCFS's and LCFS's at each cv (the authors' 2.0–3.2× and ≤ 1.27×)."""
    body = []
    for cv in sorted({r["cv"] for r in rows}):
        by = {r["system"]: r["attainment"] for r in rows if r["cv"] == cv}
        body.append([_fmt(cv, 0), *(_ratio(by.get("early_abort"), by.get(o)) for o in ("fcfs", "lcfs"))])
    return _table(["cv", "abort / fcfs attainment", "abort / lcfs attainment"], body)


def _ratio(a, b) -> str:
    if a is None or b is None:
        return "–"
    return "∞" if b == 0 and a > 0 else ("–" if b == 0 else f"{a / b:.2f}×")


def clustering_table(rows: list[dict]) -> str:
    body = [
        [r["system"], _fmt(r["throughput_tps"], 1), _fmt(r["throughput_rps"], 3), _fmt(r["avg_latency_s"], 2),
         _fmt(r["p99_latency_s"], 2), _fmt(r["jain_fairness"], 3), f"{r['completed']}/{r['requests']}"]
        for r in rows
    ]  # fmt: skip
    return _table(
        ["C", "tokens/s", "requests/s", "avg latency (s)", "p99 latency (s)", "Jain fairness", "completed"],
        body,
    )


def pets_table(rows: list[dict]) -> str:
    body = [
        [_fmt(r["sigma"], 0), r["system"], str(r["requests"]), str(r["prompt_tokens"]),
         _fmt(r["prefill_queue_s"], 2), _fmt(r["prompts_per_s"], 1)]
        for r in rows
    ]  # fmt: skip
    return _table(["σ", "policy", "prompts", "prompt tokens", "queue prefilled in (s)", "prompts/s"], body)


def probe_table(probe: dict) -> str:
    steps = probe["decode_step_s"]
    body = [
        ["decode step, no adapter (ms)", _fmt(1000 * steps["base"], 1)],
        ["decode step, one adapter for all (ms)", _fmt(1000 * steps["one_adapter"], 1)],
        [f"decode step, {probe['batch']} distinct adapters (ms)", _fmt(1000 * steps["distinct_adapters"], 1)],
        ["BAx/Wx, one adapter", f"{100 * probe['bax_over_wx_one_adapter']:.1f}%"],
        [f"BAx/Wx, {probe['batch']} adapters", f"{100 * probe['bax_over_wx_distinct_adapters']:.1f}%"],
        ["t_M: merge + unmerge, rank 8 (ms)", _fmt(1000 * probe["merge_unmerge_s"], 1)],
    ]
    return _table(["measure", "value"], body)


def report(results: dict) -> str:
    """The whole results file as markdown."""
    parts = [f"# Batch policies ({results['profile']['name']} profile)", ""]
    calibration = results.get("calibration", {})
    if calibration:
        parts += [
            (
                f"Capacity {calibration['capacity_rps']:.3f} req/s; low-load median first token "
                f"{calibration['low_load_median_first_token_s']:.3f} s; first-token SLO {calibration['slo_s']:.2f} s; "
                f"load average {results.get('loadavg', '?')}."
            ),
            "",
        ]
    sections = [
        ("lora_cost", "LoRA cost and merge time", probe_table),
        ("skew", "dLoRA skew sweep", skew_table),
        ("abort", "S-LoRA early abort", abort_table),
        ("abort", "Abort's attainment ratios", abort_ratios),
        ("clustering", "Adapter clustering", clustering_table),
        ("pets", "PetS prefill", pets_table),
    ]
    for key, title, render in sections:
        if results.get(key):
            parts += [f"## {title}", "", render(results[key]), ""]
    return "\n".join(parts)
