"""The experiment's table (markdown) and plot (p99 latency per policy and trace).

Rebuild them from one or more ``results.json`` (e.g. runs of different seeds or sizes)::

    .venv/bin/python -m bench.cluster_sim.report --inputs a/results.json b/results.json --out bench/out/cluster_sim
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.out_dir import default_out


def table(rows: list[dict]) -> str:
    head = ("| workers | seed | trace | policy | p50 s | p99 s | p99 first→last token s | first-token SLO | req/s "
            "| tok/s | migrations/min | prefetches | preemptions |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")  # fmt: skip
    lines = [
        f"| {r['workers']} | {r.get('seed', 0)} | {r['trace']} | {r['policy']} | {r['p50_latency_s']:.2f} | {r['p99_latency_s']:.2f} "
        f"| {r['decode_bound_p99_s']:.2f} | {r['slo_attainment']:.1%} | {r['throughput_rps']:.2f} "
        f"| {r['tokens_per_s']:.0f} | {r['migrations_per_min']:.1f} | {r['prefetches']} | {r['preemptions']} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    sizes = sorted({r["workers"] for r in rows})
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, axes = plt.subplots(len(sizes), 1, figsize=(12, 4 * len(sizes)), squeeze=False)
    width = 0.8 / len(policies)
    for ax, workers in zip(axes[:, 0], sizes, strict=True):
        for k, policy in enumerate(policies):
            values = [
                next((r["p99_latency_s"] for r in rows
                      if r["workers"] == workers and r["trace"] == t and r["policy"] == policy), 0.0)
                for t in traces
            ]  # fmt: skip
            ax.bar([i + k * width for i in range(len(traces))], values, width, label=policy)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(traces))], traces, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("p99 latency (s, log)")
        seeds = sorted({r.get("seed", 0) for r in rows if r["workers"] == workers})
        ax.set_title(f"{workers} simulated workers, trace seed {', '.join(map(str, seeds))}")
    axes[0, 0].legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ratio_table(rows: list[dict], baseline: str = "LEW", contender: str = "LEW+prefetch+co-migration") -> str:
    """``baseline``'s p99 over ``contender``'s per (workers, trace), one column per seed (> 1:
    the contender is better)."""
    seeds = list(dict.fromkeys(r.get("seed", 0) for r in rows))
    p99 = {(r.get("seed", 0), r["workers"], r["trace"], r["policy"]): r["p99_latency_s"] for r in rows}
    cells = list(dict.fromkeys((r["workers"], r["trace"]) for r in rows))
    head = (f"| workers | trace | {' | '.join(f'seed {s}' for s in seeds)} |\n"
            f"|---|---|{'---|' * len(seeds)}\n")  # fmt: skip
    lines = []
    for workers, trace in cells:
        ratios = []
        for seed in seeds:
            base, new = p99.get((seed, workers, trace, baseline)), p99.get((seed, workers, trace, contender))
            ratios.append(f"{base / new:.2f}×" if base and new else "–")
        lines.append(f"| {workers} | {trace} | {' | '.join(ratios)} |")
    return head + "\n".join(lines) + "\n"


COMBINATIONS = ("LEW+prefetch+co-migration", "LEW+batch-balancing", "LEW+prefetch+batch-balancing")
"""Policy sets compared with LEW in the ratio tables (those the rows have)."""


def write_report(
    out: Path, meta: dict, rows: list[dict], table_runs: list[tuple[int, int]] | None = None
) -> None:
    """``results.md`` (the table of the ``(workers, seed)`` runs in ``table_runs``, default each
    size's first seed, and for each of :data:`COMBINATIONS` in the rows the ratio table of every
    seed) and ``p99.png`` (the table's rows)."""
    header = (
        f"CPU of the calibration: {meta['cpu_model']}; capacity {meta['capacity_rps_per_worker']:.2f} req/s "
        f"per worker (estimated), load {meta['load']:.0%}, first-token SLO {meta['slo_s']:.2f} s, "
        f"{meta['adapters']} adapters, {meta['duration_s']:.0f} s per trace.\n\n"
    )
    if table_runs is None:
        table_runs = list({r["workers"]: (r["workers"], r.get("seed", 0)) for r in reversed(rows)}.values())
    first = [r for r in rows if (r["workers"], r.get("seed", 0)) in table_runs]
    present = {r["policy"] for r in rows}
    ratios = "".join(
        f"\nLEW's p99 over {name}'s, per seed:\n\n" + ratio_table(rows, contender=name)
        for name in COMBINATIONS
        if name in present
    )
    (out / "results.md").write_text(header + table(first) + ratios)
    plot(first, out / "p99.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", nargs="+", required=True, help="results.json files of experiment runs")
    parser.add_argument("--out", default=str(default_out("cluster_sim")))
    parser.add_argument(
        "--table", nargs="*", metavar="WORKERS:SEED", help="runs whose rows the table shows (e.g. 16:1 64:0)"
    )
    args = parser.parse_args()
    runs = [json.loads(Path(path).read_text()) for path in args.inputs]
    # A run given twice (the simulator is deterministic) counts once: the last one's row stays.
    unique = {
        (r.get("seed", 0), r["workers"], r["trace"], r["policy"]): r for run in runs for r in run["rows"]
    }
    # Grouped as one run writes them: by size, seed, trace, then policy (traces and policies in
    # first-seen order).
    seen = [list(dict.fromkeys(key[i] for key in unique)) for i in (2, 3)]
    keys = sorted(unique, key=lambda k: (k[1], k[0], seen[0].index(k[2]), seen[1].index(k[3])))
    rows = [unique[k] for k in keys]
    seeds = list(dict.fromkeys(row.get("seed", 0) for row in rows))
    meta = {**runs[0]["meta"], "seeds": seeds}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    runs_shown = [tuple(int(x) for x in item.split(":")) for item in args.table] if args.table else None
    write_report(out, meta, rows, runs_shown)


if __name__ == "__main__":
    main()
