"""Tables (markdown) and the plot from a run's ``results.json``."""

from __future__ import annotations

from pathlib import Path

WORKLOAD_CONFIGURATIONS = ("borrow", "preempt", "alone")


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def context_table(results: dict) -> str:
    rows = ["| configuration | one pool (tokens) | longest context served | first not served | probes (context: served?) | × one worker alone |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    contexts = results["longest_context"]
    alone = (contexts.get("alone") or {}).get("longest_served")
    for name, found in contexts.items():
        probes = ", ".join(
            f"{p['context_tokens']}: {'yes' if p['served'] else 'no'}" for p in found["probes"]
        )
        bound = found["shortest_refused"]
        refused = (
            f"{bound:,}"
            if any(p["context_tokens"] == bound for p in found["probes"])
            else f"{bound:,} (capacity bound)"
        )
        served = found["longest_served"]
        ratio = f"{served / alone:.2f}×" if served and alone else "–"
        rows.append(
            f"| {name} | {found['pool_tokens']:,} | {_fmt(served)} | {refused} | {probes} | {ratio} |"
        )
    return "\n".join(rows)


def workload_table(results: dict) -> str:
    rows = ["| long share | configuration | requests (long) | completed (long) | refused (long) | failed + stuck | served tok/s | output tok/s | short p50 / p90 s | long p50 s | preemptions | wall s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    workloads = results["workloads"]
    fractions = sorted({key for runs in workloads.values() for key in runs}, key=float)
    for fraction in fractions:
        for name in WORKLOAD_CONFIGURATIONS:
            run = workloads.get(name, {}).get(fraction)
            if run is None:
                continue
            s = run["summary"]
            short = s["short_latency_s"]
            rows.append(
                f"| {float(fraction):.0%} | {name} | {s['requests']} ({s['long_requests']}) "
                f"| {s['completed']} ({s['long_completed']}) | {s['refused']} ({s['long_refused']}) "
                f"| {s['failed'] + s['stuck']} | {_fmt(s['served_tokens_per_s'])} | {_fmt(s['output_tokens_per_s'], 2)} "
                f"| {_fmt(short['p50'])} / {_fmt(short['p90'])} | {_fmt(s['long_latency_s']['p50'])} "
                f"| {s['preemptions']} | {_fmt(s['wall_s'])} |"
            )
    return "\n".join(rows)


def batch_table(results: dict) -> str:
    rows = ["| configuration | requests | completed | wall s | served tok/s | output tok/s | vs all-local |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    batches = results["same_batch"]
    local = (batches.get("all-local") or {}).get("summary", {}).get("served_tokens_per_s")
    for name, batch in batches.items():
        s = batch["summary"]
        ratio = f"{s['served_tokens_per_s'] / local:.2f}×" if local else "–"
        rows.append(
            f"| {name} | {s['requests']} | {s['completed']} | {_fmt(s['wall_s'])} | {_fmt(s['served_tokens_per_s'])} "
            f"| {_fmt(s['output_tokens_per_s'], 2)} | {ratio} |"
        )
    return "\n".join(rows)


def overhead_table(results: dict) -> str:
    rows = ["| configuration | decode step ms | first token s | KV borrowed (blocks per creditor) | remote attention ms/step (counters) | bytes moved/step (counters) | bytes moved/step (analytic) | KV of the remote blocks | KV ÷ moved (analytic) |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, run in results["decode_overhead"].items():
        traffic = run["analytic_traffic_per_step"]
        counters = run.get("counters_per_step")
        measured_ms = _fmt(counters["remote_attention_ms_per_step"]) if counters else "not reported"
        measured_bytes = (
            f"{counters['bytes_sent_per_step'] + counters['bytes_received_per_step']:,.0f}"
            if counters
            else "not reported"
        )
        borrowed = ", ".join(f"{n}" for n in run["borrowed_blocks"].values()) or "none"
        remote = bool(run["borrowed_blocks"])
        rows.append(
            f"| {name} | {_fmt(run['decode_step_ms'])} | {_fmt(run['outcome']['first_token_s'])} | {borrowed} "
            f"| {measured_ms if remote else '–'} | {measured_bytes if remote else '–'} "
            f"| {traffic['moved']:,} | {traffic['kv_bytes']:,} | {traffic['kv_over_moved'] if remote else '–'} |"
        )
    return "\n".join(rows)


def render(results: dict) -> str:
    m = results["machine"]
    load = results["load_average"]
    return (
        "\n\n".join(
            [
                f"# DistKV-LLM long-context benchmark ({results['profile']} profile)",
                (
                    f"Commit {results['commit']}, started {results['started']}, "
                    f"{results.get('elapsed_s', 0) / 60:.1f} min. CPU: {m['cpu']}, {m['cores']} cores, "
                    f"AVX2 {m['avx2']}, AVX-512 bf16 {m['avx512_bf16']}. Load average (1/5/15 min) "
                    f"before {load['before']}, after {load.get('after')}."
                ),
                "## Longest context served",
                context_table(results),
                "## Workload mixes (closed loop)",
                workload_table(results),
                "## Same batch: borrowing mesh vs all KV local",
                batch_table(results),
                "## Decode step of one long request",
                overhead_table(results),
            ]
        )
        + "\n"
    )


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2), dpi=90)
    contexts = results["longest_context"]
    names = list(contexts)
    values = [contexts[n]["longest_served"] or 0 for n in names]
    left.bar(names, values, color=["#888888", "#2a7ab0"][: len(names)])
    alone = contexts.get("alone", {}).get("longest_served")
    if alone:
        left.axhline(2.5 * alone, color="#c0392b", linestyle="--", linewidth=1, label="goal: 2.5× alone")
        left.legend(loc="upper left", fontsize=8)
    left.set_ylabel("longest context served (tokens)")
    left.set_title("Longest context", fontsize=10)

    workloads = results["workloads"]
    fractions = sorted({key for runs in workloads.values() for key in runs}, key=float)
    width = 0.8 / len(WORKLOAD_CONFIGURATIONS)
    for i, name in enumerate(WORKLOAD_CONFIGURATIONS):
        rates = [
            workloads.get(name, {}).get(f, {}).get("summary", {}).get("served_tokens_per_s", 0)
            for f in fractions
        ]
        right.bar([x + i * width for x in range(len(fractions))], rates, width, label=name)
    right.set_xticks([x + width for x in range(len(fractions))], [f"{float(f):.0%} long" for f in fractions])
    right.set_ylabel("served tokens/s (prompt + output)")
    right.set_title("Workload mixes, 3 workers", fontsize=10)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(results: dict, out: Path) -> None:
    (out / "results.md").write_text(render(results))
    plot(results, out / "distkv.png")
