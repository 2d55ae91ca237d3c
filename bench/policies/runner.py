"""Runs the batch-policy suite (issue 15) on the real model, in process, and writes the results.

    loramesh bench-policies --profile quick      # smoke run
    loramesh bench-policies --profile full       # the figures of bench/HISTORY.md

Order: the LoRA cost probe (BAx/Wx, t_M), the capacity of this machine now (a closed FCFS
backlog), the low-load first-token latency (for the SLO), then the four experiments. Results go
to ``<out>/results.json`` (written after each experiment), ``<out>/results.md`` and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path

from bench.out_dir import default_out
from bench.policies import (
    abort_sweep,
    clustering_sweep,
    lora_cost,
    pets_sweep,
    plots,
    preemption_sweep,
    skew_sweep,
    tables,
)
from bench.policies.capacity import DTYPE, measure_capacity, median_first_token_s
from bench.policies.harness import RunSetting, run_trace, trace_seconds, window_s
from bench.policies.profiles import PROFILES, PolicyBenchProfile
from bench.policies.traces import RANK, skewed_trace
from bench.serving.adapters import ensure_adapter_set
from bench.serving.runner import machine_info
from bench.systems.engine_system import EngineSystem, EngineSystemOptions
from services.model_files.base_model import load_base_model_spec

DEFAULT_ADAPTER_CACHE = Path.home() / ".cache" / "loramesh" / "bench-adapters-rank8"
EXPERIMENTS = ("skew", "abort", "clustering", "pets", "preemption")


def run_suite(profile: PolicyBenchProfile, out: Path, adapter_cache: Path, only: tuple[str, ...]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    spec = load_base_model_spec(None)
    count = max(profile.skew_adapters, profile.abort_adapters, profile.cluster_adapters, profile.pets_tasks)
    adapters = ensure_adapter_set(adapter_cache, spec, count, (RANK,))
    results: dict = {
        "profile": {"name": profile.name, **{k: v for k, v in vars(profile).items() if k != "name"}},
        "machine": machine_info(),
        "model": spec.name,
        "dtype": DTYPE,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "loadavg": _loadavg(),
    }

    def save() -> None:
        (out / "results.json").write_text(json.dumps(results, indent=1))

    def log(line: str) -> None:
        print(f"[{time.monotonic() - started:6.0f} s] {line}", flush=True)

    setting = RunSetting(
        adapters=adapters,
        window_s=0.0,
        max_batch=profile.max_batch,
        pool_mib=profile.pool_mib,
        seed=profile.seed,
    )
    results["lora_cost"] = lora_cost.measure(adapters, profile.max_batch, profile.probe_rounds)
    log(f"LoRA cost: {results['lora_cost']}")
    capacity = measure_capacity(
        replace(setting, window_s=600.0),
        profile.calibration_requests,
        profile.input_range,
        profile.output_range,
    )
    low_rate = profile.low_load * capacity
    low_load = skewed_trace(
        profile.skew_adapters, 1 / profile.skew_adapters, low_rate,
        trace_seconds(profile.low_load_requests, low_rate), profile.input_range, profile.output_range, profile.seed,
    )  # fmt: skip
    low_setting = replace(
        setting, window_s=window_s(profile.low_load_requests, low_rate, capacity, profile.drain_s)
    )
    median_first = median_first_token_s(
        run_trace(EngineSystem(EngineSystemOptions(name="fcfs", dtype=DTYPE)), low_load, low_setting)
    )
    slo_s = profile.abort_slo_factor * median_first
    results["calibration"] = {
        "capacity_rps": round(capacity, 4),
        "low_load_median_first_token_s": round(median_first, 4),
        "slo_s": round(slo_s, 4),
    }
    log(f"calibration: {results['calibration']}")
    save()
    experiments = {
        "skew": lambda: skew_sweep.run(profile, setting, capacity, log),
        "abort": lambda: abort_sweep.run(profile, setting, capacity, slo_s, log),
        "clustering": lambda: clustering_sweep.run(profile, setting, capacity, log),
        "pets": lambda: pets_sweep.run(profile, setting, log),
        "preemption": lambda: preemption_sweep.run(profile, setting, capacity, log),
    }
    for name in (e for e in EXPERIMENTS if e in only):
        # One experiment failing must not cost the others' (long) runs: its error is recorded.
        try:
            results[name] = experiments[name]()
        except Exception as error:  # noqa: BLE001
            results.setdefault("errors", {})[name] = f"{type(error).__name__}: {error}"
            log(f"{name} failed: {error!r}")
        save()
    results["loadavg_end"] = _loadavg()
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    save()
    (out / "results.md").write_text(tables.report(results))
    plots.write(results, out)
    return results


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="issue 15's batch-policy benchmarks")
    parser.add_argument("--profile", default="quick", choices=sorted(PROFILES))
    parser.add_argument("--out", default="", help="results folder (default bench/out/policies[-quick])")
    parser.add_argument("--only", nargs="+", choices=EXPERIMENTS, default=list(EXPERIMENTS))
    parser.add_argument("--adapter-cache", default=str(DEFAULT_ADAPTER_CACHE))
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    name = "policies" if profile.name == "full" else "policies-quick"
    out = Path(args.out) if args.out else default_out(name)
    results = run_suite(profile, out, Path(args.adapter_cache), tuple(args.only))
    print(f"\nsuite done in {results['elapsed_s'] / 60:.1f} min; report: {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
