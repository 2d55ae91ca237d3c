"""Runs a profile's experiments one after the other and writes the results.

    loramesh bench --profile quick            # or: make bench
    loramesh bench --profile full --out DIR
    loramesh bench --systems loramesh-up llamacpp llamacpp-base --llama-server PATH --repeat 3

Each run replays its trace against the wall clock, in a fresh process of its own with the torch
thread settings given (one per CPU by default, as ``loramesh up``'s worker), so that no run
inherits another's state; the runs never overlap, and each records how much of the CPUs other
processes used meanwhile (:mod:`bench.serving.isolated_run`). With ``repeat`` > 1 the whole plan runs that many rounds, one after the other, so the
systems alternate and a drift of the machine's speed shows in every system's rounds alike.
Results go to ``<out>/results.json`` (configuration, machine, per-run metrics, pool occupancy),
``<out>/results.md`` and PNG plots (see :mod:`bench.serving.report`).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path

from tqdm import tqdm

from bench.serving import report
from bench.serving.adapters import adapter_bytes, ensure_adapter_set, evict_from_page_cache
from bench.serving.calibration import batching_ceiling
from bench.serving.isolated_run import WAIT_POLICY_ENV, RunThreads, run_isolated
from bench.serving.metrics import summarize
from bench.serving.profiles import (
    GATEWAY,
    LLAMACPP,
    LLAMACPP_BASE,
    LORAMESH,
    LORAMESH_UP,
    MERGED,
    NO_UNIFIED_POOL,
    PADDED_BMM,
    PEER_SYSTEMS,
    PEFT,
    Experiment,
    Profile,
    experiments,
)
from bench.serving.system_settings import LLAMA_SERVER_ENV, NO_SETTINGS, SystemSettings
from bench.systems.base import RunContext, ServingSystem
from bench.workload import generate
from services.gpu_worker.engine.side_threads import confine_to_one_thread
from services.model_files.base_model import load_base_model_spec

DEFAULT_ADAPTER_CACHE = Path.home() / ".cache" / "loramesh" / "bench-adapters"
ENGINE_THREAD_SYSTEMS = (LORAMESH, PADDED_BMM, NO_UNIFIED_POOL)
"""The systems whose steps run on an engine thread of the bench's process (the others run on its
main thread, or in processes of their own)."""
NO_UNIFIED_POOL_ADAPTER_SHARE = 0.5
"""Share of the pool the no-unified-pool ablation reserves for adapter weights."""


def make_system(name: str, settings: SystemSettings = NO_SETTINGS) -> ServingSystem:
    """The system behind a profile's system name (imported on demand: the baselines need
    transformers and peft)."""
    if name in (LORAMESH, PADDED_BMM, NO_UNIFIED_POOL):
        from bench.systems.engine_system import EngineSystem, EngineSystemOptions

        options = {
            LORAMESH: EngineSystemOptions(name=LORAMESH),
            PADDED_BMM: EngineSystemOptions(name=PADDED_BMM, lora_backend="padded_bmm"),
            NO_UNIFIED_POOL: EngineSystemOptions(
                name=NO_UNIFIED_POOL, adapter_region_share=NO_UNIFIED_POOL_ADAPTER_SHARE
            ),
        }[name]
        return EngineSystem(options)
    if name == GATEWAY:
        from bench.systems.gateway_system import GatewaySystem

        return GatewaySystem()
    if name == PEFT:
        from bench.systems.peft_baseline import PeftBaselineSystem

        return PeftBaselineSystem()
    if name == MERGED:
        from bench.systems.merged_swap import MergedSwapSystem

        return MergedSwapSystem()
    if name in (LLAMACPP, LLAMACPP_BASE):
        from bench.systems.llamacpp_system import LlamaServerSystem, LlamaServerSystemOptions

        if settings.llama_server is None:
            raise ValueError(
                f"{name} needs a llama-server binary: --llama-server PATH or ${LLAMA_SERVER_ENV}"
            )
        return LlamaServerSystem(
            LlamaServerSystemOptions(binary=settings.llama_server, name=name, with_adapters=name == LLAMACPP)
        )
    if name == LORAMESH_UP:
        from bench.systems.loramesh_up_system import LoraMeshUpSystem, LoraMeshUpSystemOptions

        return LoraMeshUpSystem(LoraMeshUpSystemOptions(name=name, up_args=settings.up_args))
    raise ValueError(f"unknown system {name!r}")


def machine_info(threads: RunThreads | None = None) -> dict:
    """The machine, torch, and the threads the runs get (None: this process's)."""
    import torch

    return {
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "torch_threads": threads.intra_op if threads else torch.get_num_threads(),
        "omp_wait_policy": os.environ.get(WAIT_POLICY_ENV, "") or "default",
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_profile(
    profile: Profile,
    out: Path,
    model_path: str | None = None,
    adapter_cache: Path = DEFAULT_ADAPTER_CACHE,
    only: Callable[[Experiment], bool] = lambda e: e.system not in PEER_SYSTEMS,
    settings: SystemSettings = NO_SETTINGS,
    repeat: int = 1,
    threads: RunThreads | None = None,
) -> dict:
    """Run every experiment of ``profile`` that ``only`` keeps (by default all but the comparison
    with llama.cpp), ``repeat`` rounds of them, each in its own process with ``threads`` (None:
    :meth:`RunThreads.per_cpu`), and write the results to ``out``."""
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    out.mkdir(parents=True, exist_ok=True)
    planned = [e for e in experiments(profile) if only(e)]
    spec = load_base_model_spec(model_path)
    largest = max(e.workload.adapters for e in planned)
    print(f"preparing {largest} adapters in {adapter_cache} (written once, reused)", flush=True)
    ensure_adapter_set(adapter_cache, spec, largest, profile.workload.ranks)
    traces = {e.key: generate(e.workload) for e in planned}
    threads = threads or RunThreads.per_cpu()
    print("measuring the batching ceiling (decode at batch 1 vs full batch)", flush=True)
    ceiling = run_isolated(batching_ceiling, (model_path, profile.max_batch), threads)
    results = {
        "profile": asdict(profile),
        "machine": machine_info(threads),
        "model": spec.name,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "repeat": repeat,
        "threads": asdict(threads),
        "batching_ceiling": {**ceiling["result"], "threads": ceiling["threads"], "load": ceiling["load"]},
        "runs": [],
    }
    total = repeat * sum(len(t) for t in traces.values())
    started = time.monotonic()
    with tqdm(total=total, unit="req", desc="bench", dynamic_ncols=True) as bar:
        for round_index, experiment in ((r, e) for r in range(repeat) for e in planned):
            bar.set_postfix_str(experiment.key)
            trace = traces[experiment.key]
            child = partial(_run_one, profile, experiment, trace, model_path, adapter_cache, spec, settings)
            isolated = run_isolated(child, (), threads)
            bar.update(len(trace))
            run = {**isolated["result"], "threads": isolated["threads"], "load": isolated["load"]}
            run["round"] = round_index
            results["runs"].append(run)
            m = run["metrics"]
            tqdm.write(
                f"{experiment.key}{f' (round {round_index + 1})' if repeat > 1 else ''}: "
                f"{m['throughput_rps']:.2f} req/s, {m['throughput_tps']:.1f} tok/s, "
                f"first token {_fmt(m['avg_first_token_s'])} s, SLO {100 * m['slo_attainment']:.0f}%, "
                f"{m['completed']}/{m['requests']} done; others used "
                f"{100 * run['load']['others_cpu_share']:.0f}% of the CPUs"
            )
            (out / "results.json").write_text(json.dumps(results, indent=1))
    results["elapsed_s"] = time.monotonic() - started
    (out / "results.json").write_text(json.dumps(results, indent=1))
    report.write(results, out)
    return results


def _run_one(profile, experiment, trace, model_path, adapter_cache, spec, settings: SystemSettings) -> dict:
    """One experiment's run, in the process :func:`run_isolated` started for it."""
    system: ServingSystem = make_system(experiment.system, settings)
    if experiment.system in ENGINE_THREAD_SYSTEMS:
        # This process is the run's own: its main thread only sets up and replays, as a worker's
        # event loop thread, so the engine's thread has the only OpenMP team, as in a worker.
        confine_to_one_thread()
    adapters = ensure_adapter_set(adapter_cache, spec, experiment.workload.adapters, profile.workload.ranks)
    evict_from_page_cache(adapters)
    samples: list[dict] = []
    window = experiment.workload.duration_s + profile.drain_s
    context = RunContext(
        trace=trace,
        adapters=adapters,
        window_s=window,
        model_path=model_path,
        max_batch=profile.max_batch,
        pool_mib=experiment.pool_mib or profile.pool_mib,
        host_cache_mib=profile.host_cache_mib,
        on_sample=lambda t, stats: samples.append(
            {
                "t": round(t, 3),
                **{
                    k: stats[k] for k in ("kv_pages", "adapter_pages", "free_pages", "total_pages", "running")
                },
            }
        ),
    )
    began = time.monotonic()
    records = system.run(context)
    metrics = summarize(records, window, profile.slo_s)
    return {
        "system": experiment.system,
        "key": experiment.key,
        "sweeps": list(experiment.sweeps),
        "workload": asdict(experiment.workload),
        "pool_mib": experiment.pool_mib or profile.pool_mib,
        "adapter_bytes": adapter_bytes(adapters),
        "wall_s": round(time.monotonic() - began, 2),
        "metrics": metrics.to_dict(),
        "pool_samples": samples,
        "system_stats": getattr(system, "stats", dict)(),
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
