"""Small PNG plots of the suite's results."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.policies.tables import systems_of

SIZE = (4.8, 3.2)
DPI = 90


def _lines(ax, rows: list[dict], x: str, y: str) -> None:
    for system in systems_of(rows):
        points = sorted((r[x], r[y]) for r in rows if r["system"] == system and r[y] is not None)
        if points:
            ax.plot(*zip(*points), marker="o", label=system)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def write(results: dict, out: Path) -> list[Path]:
    written = []
    if results.get("skew"):
        fig, ax = plt.subplots(figsize=SIZE)
        _lines(ax, results["skew"], "top_share", "avg_latency_s")
        ax.set(
            xlabel="top adapter's share of requests", ylabel="average latency (s)", title="dLoRA skew sweep"
        )
        written.append(_save(fig, out / "skew_latency.png"))
    if results.get("abort"):
        fig, axes = plt.subplots(1, 2, figsize=(SIZE[0] * 1.8, SIZE[1]))
        _lines(axes[0], results["abort"], "cv", "attainment")
        axes[0].set(xscale="log", xlabel="cv", ylabel="SLO attainment", title="first-token SLO attainment")
        _lines(axes[1], results["abort"], "cv", "quadratic_satisfaction")
        axes[1].set(xscale="log", xlabel="cv", ylabel="1 − (t/SLO)²", title="user satisfaction (quadratic)")
        written.append(_save(fig, out / "abort_slo.png"))
    if results.get("clustering"):
        rows = results["clustering"]
        fig, axes = plt.subplots(1, 2, figsize=(SIZE[0] * 1.8, SIZE[1]))
        labels = [r["system"] for r in rows]
        axes[0].bar(labels, [r["throughput_tps"] for r in rows], color="tab:blue")
        axes[0].set(ylabel="output tokens/s", title="clustering: throughput")
        axes[1].bar(labels, [r["avg_latency_s"] or 0 for r in rows], color="tab:orange")
        axes[1].set(ylabel="average latency (s)", title="clustering: latency")
        written.append(_save(fig, out / "clustering.png"))
    if results.get("pets"):
        fig, ax = plt.subplots(figsize=SIZE)
        _lines(ax, results["pets"], "sigma", "prefill_queue_s")
        ax.set(xlabel="σ of prompt lengths", ylabel="queue prefilled in (s)", title="PetS DP vs FCFS prefill")
        written.append(_save(fig, out / "pets_prefill.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
