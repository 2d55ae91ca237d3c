"""Turns a results dict (see :mod:`bench.serving.runner`) into a markdown report and PNG plots.

    python -m bench.serving.report bench/out/quick     # redraw from results.json

Plots: throughput vs number of adapters, average first-token latency vs request rate, SLO
attainment vs cv, and the unified pool's occupancy over time in loramesh's default run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.out_dir import default_out
from bench.serving.isolated_run import LOADED_SHARE, loaded
from bench.serving.profiles import (
    GATEWAY,
    LLAMACPP,
    LLAMACPP_BASE,
    LORAMESH,
    LORAMESH_UP,
    MERGED,
    NO_UNIFIED_POOL,
    PADDED_BMM,
    PEFT,
)

PLOTS = {
    "throughput_vs_adapters": "throughput_vs_adapters.png",
    "first_token_vs_rate": "first_token_vs_rate.png",
    "slo_vs_cv": "slo_vs_cv.png",
    "pool_occupancy": "pool_occupancy.png",
}
STYLE = {
    LORAMESH: {"color": "tab:blue", "marker": "o"},
    GATEWAY: {"color": "tab:cyan", "marker": "D"},
    PEFT: {"color": "tab:red", "marker": "s"},
    MERGED: {"color": "tab:orange", "marker": "^"},
    PADDED_BMM: {"color": "tab:purple", "marker": "v"},
    NO_UNIFIED_POOL: {"color": "tab:green", "marker": "P"},
    LORAMESH_UP: {"color": "tab:olive", "marker": "X"},
    LLAMACPP: {"color": "tab:brown", "marker": "*"},
    LLAMACPP_BASE: {"color": "tab:gray", "marker": "*"},
}


def write(results: dict, out: Path) -> None:
    _plot_sweep(results, "adapters", "adapters", "throughput_tps", out / PLOTS["throughput_vs_adapters"],
                title="Throughput vs number of adapters", xlabel="number of adapters n (log scale)",
                ylabel="throughput (output tokens/s)", logx=True, sweeps=("adapters", "ablation", "comparison"))  # fmt: skip
    _plot_sweep(results, "rate", "rate", "avg_first_token_s", out / PLOTS["first_token_vs_rate"],
                title="Average first-token latency vs request rate", xlabel="total request rate R (requests/s)",
                ylabel="average first-token latency (s)")  # fmt: skip
    _plot_sweep(results, "cv", "cv", "slo_attainment", out / PLOTS["slo_vs_cv"],
                title=f"SLO attainment vs burstiness (first token within {results['profile']['slo_s']:g} s)",
                xlabel="coefficient of variation cv of arrivals", ylabel="SLO attainment (%)", percent=True)  # fmt: skip
    _plot_pool(results, out / PLOTS["pool_occupancy"])
    (out / "results.md").write_text(markdown(results))


def _plot_sweep(results, sweep, x_field, y_field, path, *, title, xlabel, ylabel, logx=False,
                percent=False, sweeps=None) -> None:  # fmt: skip
    wanted = sweeps or (sweep,)
    series: dict[str, list[tuple[float, float]]] = {}
    for run in results["runs"]:
        y = run["metrics"][y_field]
        if y is None or not set(run["sweeps"]) & set(wanted):
            continue
        series.setdefault(run["system"], []).append((run["workload"][x_field], 100 * y if percent else y))
    if not series:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for system, points in sorted(series.items()):
        points = sorted(set(points))
        xs, ys = zip(*points)
        ax.plot(xs, ys, label=system, linewidth=1.8, markersize=7, **STYLE.get(system, {}))
    if logx:
        ax.set_xscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, _caption(results), fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def _plot_pool(results, path) -> None:
    run = next(
        (
            r
            for r in results["runs"]
            if r["system"] == LORAMESH and "comparison" in r["sweeps"] and r["pool_samples"]
        ),
        None,
    )
    if run is None:
        return
    samples = run["pool_samples"]
    t = [s["t"] for s in samples]
    total = samples[0]["total_pages"]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.stackplot(
        t,
        [100 * s["kv_pages"] / total for s in samples],
        [100 * s["adapter_pages"] / total for s in samples],
        labels=["KV cache pages", "adapter weight pages"],
        colors=["tab:blue", "tab:orange"],
        alpha=0.8,
    )
    ax.set_title(f"Unified pool occupancy, loramesh, {run['key']}")
    ax.set_xlabel("time since the start of the trace (s)")
    ax.set_ylabel(f"share of the pool's {total} pages (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.text(0.01, 0.01, _caption(results), fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def _caption(results) -> str:
    m, p = results["machine"], results["profile"]
    w = p["workload"]
    return (
        f"{results['model']}, {m['cpus']} CPUs ({m['cpu']}); profile {p['name']}: α={w['alpha']:g}, "
        f"I=U{list(w['input_range'])}, O=U{list(w['output_range'])}, ranks {list(w['ranks'])}, D={w['duration_s']:g} s"
    )


def _by_key(results) -> dict[tuple[str, int, float, float], dict]:
    """Runs with the profile's pool, by (system, n, R, cv): their metrics, and under ``loaded``
    whether other processes loaded the machine during the run."""
    pool = results["profile"]["pool_mib"]
    return {
        (r["system"], r["workload"]["adapters"], r["workload"]["rate"], r["workload"]["cv"]): {
            **r["metrics"],
            "loaded": loaded(r),
            "others_cpu_share": r.get("load", {}).get("others_cpu_share"),
        }
        for r in results["runs"]
        if r.get("pool_mib", pool) == pool
    }


def _unsound(*runs: dict) -> str:
    """Why a ratio over ``runs`` is not quoted (empty: it is): other processes loaded the machine."""
    shares = [f"{100 * r['others_cpu_share']:.0f}%" for r in runs if r["loaded"]]
    if not shares:
        return ""
    return (
        f"not quoted: other processes used {' and '.join(shares)} of the CPUs during the runs "
        f"(more than {100 * LOADED_SHARE:.0f}%), and a small-batch step collapses under such load"
    )


def headline(results) -> list[str]:
    """The figures the issue asks about, as sentences (empty where a run is missing)."""
    p = results["profile"]
    w = p["workload"]
    runs = _by_key(results)
    n = p["comparison_adapters"]
    lines = []
    ours, peft = runs.get((LORAMESH, n, w["rate"], w["cv"])), runs.get((PEFT, n, w["rate"], w["cv"]))
    if ours and peft:
        verdict = _unsound(ours, peft) or f"**{_ratio(ours, peft)}×**"
        lines.append(
            f"loramesh vs PEFT at n={n}, R={w['rate']:g}: throughput {ours['throughput_tps']:.1f} vs "
            f"{peft['throughput_tps']:.1f} tok/s = {verdict} ({ours['throughput_rps']:.2f} vs "
            f"{peft['throughput_rps']:.2f} completed req/s); average first-token latency "
            f"{_fmt(ours['avg_first_token_s'])} vs {_fmt(peft['avg_first_token_s'])} s."
        )
    largest = max(p["adapter_counts"])
    at_n, at_largest = (
        runs.get((LORAMESH, n, w["rate"], w["cv"])),
        runs.get((LORAMESH, largest, w["rate"], w["cv"])),
    )
    if at_n and at_largest and largest != n:
        verdict = _unsound(at_largest, at_n) or f"**{_ratio(at_largest, at_n)}×**"
        lines.append(
            f"loramesh throughput at n={largest} vs n={n}: {at_largest['throughput_tps']:.1f} vs "
            f"{at_n['throughput_tps']:.1f} tok/s = {verdict}."
        )
    for system in (PADDED_BMM, NO_UNIFIED_POOL, MERGED, GATEWAY):
        other = runs.get((system, n, w["rate"], w["cv"]))
        if at_n and other:
            verdict = _unsound(other, at_n) or f"{_ratio(other, at_n)}×"
            lines.append(
                f"{system} at n={n}: {other['throughput_tps']:.1f} tok/s = {verdict} loramesh; "
                f"first token {_fmt(other['avg_first_token_s'])} s (loramesh {_fmt(at_n['avg_first_token_s'])} s)."
            )
    pressure = {r["system"]: r for r in results["runs"] if "pressure" in r["sweeps"]}
    if LORAMESH in pressure and NO_UNIFIED_POOL in pressure:
        ours, split = pressure[LORAMESH]["metrics"], pressure[NO_UNIFIED_POOL]["metrics"]
        lines.append(
            f"With a {pressure[LORAMESH]['pool_mib']:g} MiB pool (KV and adapters compete): unified "
            f"{ours['throughput_tps']:.1f} tok/s, split {split['throughput_tps']:.1f} tok/s = {_ratio(split, ours)}× "
            f"(first token {_fmt(ours['avg_first_token_s'])} vs {_fmt(split['avg_first_token_s'])} s)."
        )
    return lines


def markdown(results) -> str:
    p, m = results["profile"], results["machine"]
    w = p["workload"]
    out = [
        f"# loramesh bench — profile `{p['name']}`",
        "",
        f"Model {results['model']}; {m['cpus']} CPUs ({m['cpu']}), torch {m['torch']} with "
        f"{m['torch_threads']} threads"
        + (
            f" (OpenMP wait policy {m['omp_wait_policy']}), each run in its own process"
            if "omp_wait_policy" in m
            else ""
        )
        + f"; started {results['started']}"
        + (f", {results['elapsed_s'] / 60:.1f} min in all." if "elapsed_s" in results else "."),
        "",
        (
            f"Default workload: α={w['alpha']:g}, R={w['rate']:g} req/s, cv={w['cv']:g}, input U{list(w['input_range'])}, "
            f"output U{list(w['output_range'])} tokens, ranks {list(w['ranks'])} round-robin (q/k/v/o), "
            f"D={w['duration_s']:g} s + {p['drain_s']:g} s to drain; batch ≤ {p['max_batch']}, pool {p['pool_mib']:g} MiB, "
            f"host adapter budget {p['host_cache_mib']:g} MiB; SLO: first token within {p['slo_s']:g} s."
        ),
        "",
        *[f"- {line}" for line in headline(results)],
        *_ceiling(results),
        *llamacpp_comparison(results),
        "",
        (
            "| system | n | R (req/s) | cv | pool (MiB) | done | req/s | tok/s | avg latency (s) | p99 latency (s) "
            "| avg first token (s) | SLO attainment | user satisfaction | others' CPU |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in results["runs"]:
        r, wl = run["metrics"], run["workload"]
        out.append(
            f"| {run['system']} | {wl['adapters']} | {wl['rate']:g} | {wl['cv']:g} "
            f"| {run.get('pool_mib', p['pool_mib']):g} | {r['completed']}/{r['requests']} "
            f"| {r['throughput_rps']:.2f} | {r['throughput_tps']:.1f} | {_fmt(r['avg_latency_s'])} "
            f"| {_fmt(r['p99_latency_s'])} | {_fmt(r['avg_first_token_s'])} | {100 * r['slo_attainment']:.0f}% "
            f"| {r['user_satisfaction']:.2f} | {_share(run)} |"
        )
    out += ["", *(f"![{name}]({file})" for name, file in PLOTS.items()), ""]
    return "\n".join(out)


def _share(run: dict) -> str:
    """Others' share of the CPUs during ``run``, marked when loaded (``-``: not recorded)."""
    share = run.get("load", {}).get("others_cpu_share")
    if share is None:
        return "-"
    return f"{100 * share:.0f}%" + (" (loaded)" if loaded(run) else "")


def _ceiling(results) -> list[str]:
    ceiling = results.get("batching_ceiling")
    if not ceiling:
        return []
    batch = results["profile"]["max_batch"]
    config = ceiling.get("configuration", {})
    where = (
        f"{config['of']}: {config['quantization']} weights, {config['dtype']} activations, "
        f"{config['torch_threads']} threads"
        if config
        else "engine, base model"
    )
    ratio = f"**{ceiling['ratio']:.1f}×**"
    if loaded(ceiling):
        ratio = f"{ceiling['ratio']:.1f}×, not quoted: other processes used {_share(ceiling)} of the CPUs"
    line = (
        f"- Batching ceiling on this machine ({where}; decode): {ceiling['batch_1_tok_s']:.1f} "
        f"tok/s at batch 1, {ceiling[f'batch_{batch}_tok_s']:.1f} tok/s at batch {batch}: {ratio}. "
        "No system batching across adapters can beat one that serves one request at a time by more."
    )
    engine = ceiling.get("bench_engine")
    if engine:
        line += (
            f" On the in-process engine's configuration ({engine['configuration']['dtype']}, weights "
            f"dequantized): {engine['batch_1_tok_s']:.1f} and {engine[f'batch_{batch}_tok_s']:.1f} tok/s, "
            f"{engine['ratio']:.1f}×."
        )
    return [line]


def llamacpp_comparison(results) -> list[str]:
    """The comparison with llama.cpp's llama-server, round by round: each system's throughput
    and first-token SLO attainment, and loramesh-up's throughput over each llama.cpp system's
    (empty when loramesh-up ran without either)."""
    rounds: dict[int, dict[str, dict]] = {}
    for run in results["runs"]:
        if "llamacpp" in run["sweeps"]:
            rounds.setdefault(run.get("round", 0), {})[run["system"]] = run["metrics"]
    peers = [s for s in (LLAMACPP, LLAMACPP_BASE) if any(s in r for r in rounds.values())]
    if not peers or not any(LORAMESH_UP in r for r in rounds.values()):
        return []
    systems = [LORAMESH_UP, *peers]
    header = "| round | " + " | ".join(f"{s} tok/s (SLO)" for s in systems)
    header += "".join(f" | {LORAMESH_UP} ÷ {s}" for s in peers) + " |"
    out = ["", f"loramesh vs llama.cpp (same trace, same HTTP client; {len(rounds)} round(s)):", "", header,
           "|" + "---|" * (1 + len(systems) + len(peers))]  # fmt: skip
    ratios: dict[str, list[float]] = {s: [] for s in peers}
    for index, metrics in sorted(rounds.items()):
        cells = [
            f"{metrics[s]['throughput_tps']:.1f} ({100 * metrics[s]['slo_attainment']:.0f}%)"
            if s in metrics
            else "-"
            for s in systems
        ]
        for peer in peers:
            if LORAMESH_UP in metrics and peer in metrics:
                ratio = metrics[LORAMESH_UP]["throughput_tps"] / max(metrics[peer]["throughput_tps"], 1e-9)
                ratios[peer].append(ratio)
                cells.append(f"**{ratio:.2f}×**")
            else:
                cells.append("-")
        out.append(f"| {index + 1} | " + " | ".join(cells) + " |")
    if len(rounds) > 1:
        means = [
            f"{LORAMESH_UP} ÷ {p}: {sum(r) / len(r):.2f}× mean of {len(r)}" for p, r in ratios.items() if r
        ]
        out += ["", "Over the rounds: " + "; ".join(means) + "."]
    return out


def _ratio(a: dict, b: dict) -> str:
    return f"{a['throughput_tps'] / max(b['throughput_tps'], 1e-9):.2f}"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else default_out("quick")
    write(json.loads((out / "results.json").read_text()), out)
    print(f"wrote {out / 'results.md'} and plots")


if __name__ == "__main__":
    main()
