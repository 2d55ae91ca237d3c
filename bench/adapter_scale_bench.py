"""Adapters at scale (issue 30): n = 10,000 vs n = 100 at equal offered load, and the slot cliff.

Two benches on the loramesh engine in-process (``bench/systems/engine_system.py``: the worker's
own adapter path, adapters read from a directory on demand into a bounded host cache, paged into
the pool on demand), on the real base model in its default dtype:

``scale``
    Two traces that offer exactly the same requests (arrival times, prompt and output lengths,
    ids: :func:`bench.workload.generate_shared_arrivals`) and differ only in which adapter each
    request names: drawn from n = 100 or n = 10,000 adapters by S-LoRA's power law (α = 1 by
    default). The rate saturates the engine, so both runs are saturated the same way and the
    throughput ratio n = 10,000 ÷ n = 100 measures what the extra adapters cost (issue 30: ≥ 0.9;
    S-LoRA keeps 0.90-0.95 at 2,000). Rounds alternate the order of the two runs.
``cliff``
    The pool's adapter pages are a fixed region holding exactly ``slots`` adapters (the split
    pool of ablation (f), sized by :func:`slot_region_pages` and checked by loading adapters
    into a pool of that shape), the KV the rest of the pool. Case "fit": ``slots`` active
    adapters; case "2x": ``2 × slots``, requests spread uniformly over them; the same arrivals
    and lengths. Issue 30: p50 first-token latency ≤ 3× and throughput ≥ 0.8× the "fit" case.
    Run at each rate of ``rates`` (below saturation and above).

Adapters are rank 8 on q_proj and v_proj (≈0.9 MB of float16 PEFT files for SmolLM2-135M), seed
= index; only the adapters a trace names are written (the others are never read: nothing in the
worker's request path touches an adapter no request names), and their page cache is dropped
before every run, so each first use reads the disk.

    python -m bench.adapter_scale_bench scale [--quick] [--rounds N] [--out DIR]
    python -m bench.adapter_scale_bench cliff [--quick] [--rounds N] [--rates R ...]

Results: ``<out>/<bench>.json`` (settings, machine, every run) and ``<out>/<bench>.md``, by
default under ``bench/out/adapter-scale/``. On a machine shared with other work, compare output
tokens per CPU-second of this process (``tokens_per_cpu_s``) rather than tok/s: a saturated
engine's tok/s follows the share of the CPUs the other work leaves (``others_cpus``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from bench.out_dir import default_out
from bench.sample_adapters import CONFIG_FILE, WEIGHTS_FILE, SampleAdapterSpec, write_peft_adapter
from bench.serving.metrics import summarize
from bench.systems.base import AdapterSet, RequestRecord, RunContext
from bench.workload import TraceRequest, WorkloadSpec, generate_shared_arrivals
from services.model_files.base_model import BaseModelSpec, load_base_model_spec

RANK = 8
TARGETS = ("q_proj", "v_proj")
DEFAULT_ADAPTER_ROOT = Path.home() / ".cache" / "loramesh" / "bench-adapters-scale"

BASE_WORKLOAD = WorkloadSpec(
    adapters=100,
    alpha=1.0,
    rate=12.0,
    cv=1.0,
    input_range=(8, 64),
    output_range=(8, 64),
    ranks=(RANK,),
    duration_s=40.0,
    seed=0,
)
"""The quick profile's workload (``bench/serving/profiles.py``) with rank-8 adapters, at a rate
that saturates the engine here whatever else the machine runs (it completes 6-7 req/s of this
workload on the 2-vCPU machine when nothing else runs, ≈3 when other work takes over half of it)."""
CLIFF_WORKLOAD = replace(BASE_WORKLOAD, alpha=0.0, duration_s=30.0)


@dataclass(frozen=True)
class EngineSetting:
    """The engine and worker limits every run of a bench shares."""

    pool_mib: float = 256
    host_cache_mib: float = 48
    max_batch: int = 32
    drain_s: float = 10.0
    """The measurement window is the trace's duration plus this."""
    slo_s: float = 6.0


@dataclass(frozen=True)
class ScaleBench:
    workload: WorkloadSpec = BASE_WORKLOAD
    """Its ``adapters`` is replaced by each of ``counts``."""
    counts: tuple[int, ...] = (100, 10_000)
    rounds: int = 4
    engine: EngineSetting = field(default_factory=EngineSetting)


@dataclass(frozen=True)
class CliffBench:
    workload: WorkloadSpec = CLIFF_WORKLOAD
    """Its ``adapters`` is replaced by ``slots`` and ``2 × slots``, its ``rate`` by each of ``rates``;
    ``alpha = 0``: requests spread uniformly over the active adapters."""
    slots: int = 8
    """Adapters the pool's adapter region holds at once (SGLang's case: 8 slots, 16 active)."""
    rates: tuple[float, ...] = (2.5, 4.0, 12.0)
    """Offered loads (req/s): two the engine keeps up with (the first-token latency compares
    there), one that saturates it (the throughput compares there)."""
    rounds: int = 2
    engine: EngineSetting = field(default_factory=EngineSetting)


SCALE_QUICK = ScaleBench(workload=replace(BASE_WORKLOAD, duration_s=20.0), rounds=1)
CLIFF_QUICK = CliffBench(workload=replace(CliffBench().workload, duration_s=20.0), rounds=1)


# -- traces and adapters ---------------------------------------------------------------------------


def offered(trace: list[TraceRequest]) -> list[tuple]:
    """What a trace offers, whatever the adapters: each request's id, arrival and lengths."""
    return [(r.request_id, r.time_s, r.input_len, r.output_len) for r in trace]


def equal_load_traces(workload: WorkloadSpec, counts: tuple[int, ...]) -> dict[int, list[TraceRequest]]:
    """One trace per adapter count, all offering the same requests (checked)."""
    traces = {n: generate_shared_arrivals(replace(workload, adapters=n)) for n in counts}
    first = offered(next(iter(traces.values())))
    if any(offered(t) != first for t in traces.values()):
        raise AssertionError("the traces do not offer the same requests")
    return traces


def adapter_root(base: Path, spec: BaseModelSpec) -> Path:
    """Where this model's rank-8 q/v adapters live (one folder per model)."""
    return base / f"{spec.name}-r{RANK}-{'-'.join(TARGETS)}"


def ensure_adapters(root: Path, spec: BaseModelSpec, indices: set[int], count: int) -> AdapterSet:
    """An :class:`AdapterSet` of ``count`` adapters of which those in ``indices`` are on disk
    (written now when missing; the weights file is written last, so its presence marks a whole
    adapter)."""
    for index in sorted(indices):
        directory = root / AdapterSet.name(index)
        if not (directory / WEIGHTS_FILE).exists() or not (directory / CONFIG_FILE).exists():
            write_peft_adapter(
                directory, spec, SampleAdapterSpec(rank=RANK, target_modules=TARGETS, seed=index)
            )
    return AdapterSet(root, (RANK,) * count)


def drop_page_cache(adapters: AdapterSet, indices: set[int]) -> None:
    """Drop these adapters' file pages so the run reads them from the disk again."""
    for index in indices:
        for path in adapters.directory(index).iterdir():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# -- slots -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotRegion:
    region_pages: int
    """Pages of the pool's adapter region."""
    total_pages: int
    """Pages of the whole pool."""
    adapter_pages: int
    """Pages one adapter takes when its pages are adjacent."""
    upper_bound_pages: int
    """Pages the residency asks to have free before it loads one (its upper bound)."""
    slots_checked: int
    """Adapters the region held at once, loaded one after the other and also after churn."""

    @property
    def share(self) -> float:
        """``EngineConfig.adapter_region_share`` giving ``region_pages`` exactly."""
        return self.region_pages / self.total_pages


def slot_region_pages(model_path: str | None, adapter_dir: Path, pool_mib: float, slots: int) -> SlotRegion:
    """Size the adapter region of a ``pool_mib`` split pool to hold exactly ``slots`` adapters like
    the one in ``adapter_dir``, and check it in a pool of that shape: ``slots`` distinct adapters,
    all held, fit; one more does not; and after 200 random releases and loads of other adapters
    ``slots`` still fit (pages freed out of order may not be adjacent)."""
    from services.gpu_worker.attention.pool_view import PoolLayout, PoolView
    from services.gpu_worker.engine.engine_config import EngineConfig
    from services.gpu_worker.lora.host_adapter import parse_peft_adapter
    from services.gpu_worker.memory.adapter_residency import AdapterResidency
    from services.gpu_worker.memory.page_allocator import PoolExhausted
    from services.gpu_worker.memory.unified_pool import UnifiedPool
    from services.gpu_worker.service import resolve_dtype

    spec = load_base_model_spec(model_path)
    dtype = resolve_dtype("auto", torch.device("cpu"))
    kv_dim, block_tokens = spec.num_kv_heads * spec.head_dim, EngineConfig().kv_block_tokens
    total = PoolLayout.pages_for_bytes(int(pool_mib * 2**20), block_tokens, kv_dim, dtype)
    config, weights = (adapter_dir / CONFIG_FILE).read_bytes(), (adapter_dir / WEIGHTS_FILE).read_bytes()

    def adapter(i: int):
        return parse_peft_adapter(f"probe-{i}", config, weights, dtype)

    def residency(region: int) -> AdapterResidency:
        layout = PoolLayout(region + 1, block_tokens, kv_dim, spec.num_layers)  # one KV page
        return AdapterResidency(UnifiedPool(PoolView.zeros(layout, dtype, "cpu"), region))

    probe = residency(4096)
    one = adapter(0)
    upper = probe.pages_needed(one)
    used = len(probe.load(one).pages)
    region = (slots - 1) * used + upper
    while True:
        held = residency(region)
        try:
            for i in range(slots):
                held.load(adapter(i))
                held.acquire(f"probe-{i}")
            rng, next_id = np.random.default_rng(0), slots
            for _ in range(200):  # churn: release one, load another, all held again
                victim = sorted(held.ids())[int(rng.integers(slots))]
                held.release(victim)
                held.load(adapter(next_id))
                held.acquire(f"probe-{next_id}")
                next_id += 1
        except PoolExhausted:
            region += 1
            continue
        break
    try:
        held.load(adapter(10**6))
        raise ValueError(f"a region of {region} pages holds more than {slots} adapters: pick another size")
    except PoolExhausted:
        pass
    if region >= total:
        raise ValueError(f"{slots} adapters need {region} pages, the whole {pool_mib} MiB pool has {total}")
    return SlotRegion(region, total, used, upper, slots)


# -- runs ------------------------------------------------------------------------------------------


def first_token_p50(records: list[RequestRecord]) -> float | None:
    """Median arrival-to-first-token over *all* requests, one without a first token counting as
    infinitely late (None when more than half have none)."""
    waits = sorted(math.inf if r.first_token_s is None else r.first_token_s - r.arrival_s for r in records)
    if not waits:
        return None
    p50 = float(np.percentile(np.array(waits), 50, method="lower"))
    return None if math.isinf(p50) else p50


def run_one(
    label: str,
    trace: list[TraceRequest],
    adapters: AdapterSet,
    engine: EngineSetting,
    model_path: str | None,
    region_share: float | None = None,
) -> dict:
    """Replay ``trace`` on a fresh engine; its metrics, p50 first token, and what the engine did."""
    from bench.systems.engine_system import EngineSystem, EngineSystemOptions

    used = {r.adapter for r in trace}
    drop_page_cache(adapters, used)
    samples: list[dict] = []
    window = trace_window(trace, engine)
    context = RunContext(
        trace=trace,
        adapters=adapters,
        window_s=window,
        model_path=model_path,
        max_batch=engine.max_batch,
        pool_mib=engine.pool_mib,
        host_cache_mib=engine.host_cache_mib,
        on_sample=lambda t, s: samples.append(
            {
                "t": round(t, 2),
                "running": s["running"],
                "queue": s["queue"],
                "resident": len(s["resident_adapters"]),
                "running_adapters": len(set(s["running_adapters"])),
            }
        ),
    )
    options = EngineSystemOptions(name=label, adapter_region_share=region_share)
    system = EngineSystem(options)
    began, cpu_before, machine_before = time.monotonic(), _process_cpu_s(), _machine_busy_s()
    records = system.run(context)
    wall = time.monotonic() - began
    cpu = _process_cpu_s() - cpu_before
    others = max(0.0, _machine_busy_s() - machine_before - cpu)
    metrics = summarize(records, window, engine.slo_s).to_dict()
    busy = [s for s in samples if s["running"] or s["queue"]]
    return {
        "label": label,
        "requests": len(trace),
        "distinct_adapters": len(used),
        "metrics": metrics,
        "p50_first_token_s": first_token_p50(records),
        "mean_running": float(np.mean([s["running"] for s in busy])) if busy else 0.0,
        "mean_running_adapters": float(np.mean([s["running_adapters"] for s in busy])) if busy else 0.0,
        "samples": samples,
        "max_resident_adapters": max((s["resident"] for s in samples), default=0),
        "system_stats": system.stats(),
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "tokens_per_cpu_s": sum(r.output_tokens for r in records) / cpu if cpu > 0 else None,
        "others_cpus": round(others / wall, 2),
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "load_avg": os.getloadavg(),
    }


def _process_cpu_s() -> float:
    """CPU seconds this process has used, all its threads (the engine's, the loader's)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (``/proc/stat``), 0 where unknown: less this
    process's own, how much of the CPUs other work took during a run."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def slots_full_share(run: dict, slots: int) -> float | None:
    """Share of a run's samples with requests queued where the running requests held ``slots``
    adapters or more: every slot taken, a queued request of another adapter cannot start."""
    queued = [s for s in run.get("samples", []) if s["queue"]]
    return sum(s["running_adapters"] >= slots for s in queued) / len(queued) if queued else None


def trace_window(trace: list[TraceRequest], engine: EngineSetting) -> float:
    """The trace's duration (its last arrival, rounded up to a whole second) plus the drain."""
    return math.ceil(max((r.time_s for r in trace), default=0.0)) + engine.drain_s


def _ordered(labels: list, round_index: int) -> list:
    """Alternate the order of the runs from one round to the next."""
    return labels if round_index % 2 == 0 else labels[::-1]


def run_scale(
    bench: ScaleBench,
    model_path: str | None = None,
    adapter_base: Path = DEFAULT_ADAPTER_ROOT,
    log: Callable[[str], None] = print,
) -> dict:
    common = _common()
    spec = load_base_model_spec(model_path)
    traces = equal_load_traces(bench.workload, bench.counts)
    root = adapter_root(adapter_base, spec)
    sets = {n: ensure_adapters(root, spec, {r.adapter for r in t}, n) for n, t in traces.items()}
    runs = []
    for round_index in range(bench.rounds):
        for n in _ordered(list(bench.counts), round_index):
            run = run_one(f"n={n}", traces[n], sets[n], bench.engine, model_path)
            run |= {"n": n, "round": round_index}
            runs.append(run)
            log(_line(run))
    return {"bench": "scale", "settings": asdict(bench), "model": spec.name, **common, "runs": runs,
            "summary": scale_summary(runs, bench.counts)}  # fmt: skip


def run_cliff(
    bench: CliffBench,
    model_path: str | None = None,
    adapter_base: Path = DEFAULT_ADAPTER_ROOT,
    log: Callable[[str], None] = print,
) -> dict:
    common = _common()
    spec = load_base_model_spec(model_path)
    root = adapter_root(adapter_base, spec)
    cases = {"fit": bench.slots, "2x": 2 * bench.slots}
    adapters = ensure_adapters(root, spec, set(range(2 * bench.slots)), 2 * bench.slots)
    region = slot_region_pages(model_path, adapters.directory(0), bench.engine.pool_mib, bench.slots)
    log(f"adapter region: {region.region_pages} of {region.total_pages} pages = {bench.slots} adapters "
        f"({region.adapter_pages} pages each, {region.upper_bound_pages} asked free to load one)")  # fmt: skip
    runs = []
    for rate in bench.rates:
        traces = equal_load_traces(replace(bench.workload, rate=rate), tuple(set(cases.values())))
        for round_index in range(bench.rounds):
            for case in _ordered(list(cases), round_index):
                run = run_one(f"{case} R={rate:g}", traces[cases[case]], adapters, bench.engine, model_path,
                              region_share=region.share)  # fmt: skip
                run |= {"case": case, "active": cases[case], "rate": rate, "round": round_index}
                run["slots_full_share"] = slots_full_share(run, bench.slots)
                runs.append(run)
                log(_line(run))
    return {"bench": "cliff", "settings": asdict(bench), "model": spec.name, **common,
            "slot_region": asdict(region), "runs": runs, "summary": cliff_summary(runs)}  # fmt: skip


def _common() -> dict:
    from bench.serving.runner import machine_info
    from services.gpu_worker.service import resolve_dtype

    return {
        "machine": machine_info(),
        "dtype": str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch."),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _line(run: dict) -> str:
    m = run["metrics"]
    p50 = run["p50_first_token_s"]
    return (
        f"{run['label']} (round {run['round'] + 1}): {m['throughput_tps']:.1f} tok/s, "
        f"{m['throughput_rps']:.2f} req/s, {m['completed']}/{m['requests']} done, "
        f"p50 first token {'-' if p50 is None else f'{p50:.2f}'} s, "
        f"{run['distinct_adapters']} adapters, {run['system_stats'].get('adapter_fetches', 0)} disk reads, "
        f"{run['system_stats'].get('adapter_page_ins', 0)} page-ins, mean batch {run['mean_running']:.1f} "
        f"({run['mean_running_adapters']:.1f} adapters), "
        f"{run['tokens_per_cpu_s'] or 0:.1f} tok/CPU-s, others used {run['others_cpus']:.2f} CPUs, "
        f"load {run['load_avg'][0]:.2f}"
    )


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return float(np.mean(kept)) if kept else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def scale_summary(runs: list[dict], counts: tuple[int, ...]) -> dict:
    """Per n: mean tok/s, req/s and output tokens per CPU-second of the process over the rounds,
    their ratios to the first n, and both ratios within each round (the two runs back to back).

    On a machine shared with other work, tok/s follows how much of the CPUs the other work leaves
    (a saturated engine is compute-bound); tokens per CPU-second of this process does not, so it
    is the ratio to read there, tok/s the one to read on a quiet machine."""
    per_n = {
        n: {
            "tok_s": _mean([r["metrics"]["throughput_tps"] for r in runs if r["n"] == n]),
            "req_s": _mean([r["metrics"]["throughput_rps"] for r in runs if r["n"] == n]),
            "tokens_per_cpu_s": _mean([r["tokens_per_cpu_s"] for r in runs if r["n"] == n]),
        }
        for n in counts
    }
    base = per_n[counts[0]]
    out = {}
    for n, v in per_n.items():
        rounds = sorted({r["round"] for r in runs})
        per_round = [_ratio(_of(runs, n, k, "tok_s"), _of(runs, counts[0], k, "tok_s")) for k in rounds]
        per_round_cpu = [_ratio(_of(runs, n, k, "cpu"), _of(runs, counts[0], k, "cpu")) for k in rounds]
        out[str(n)] = {
            **v,
            "tok_s_ratio": _ratio(v["tok_s"], base["tok_s"]),
            "req_s_ratio": _ratio(v["req_s"], base["req_s"]),
            "tokens_per_cpu_s_ratio": _ratio(v["tokens_per_cpu_s"], base["tokens_per_cpu_s"]),
            "tok_s_ratio_per_round": per_round,
            "tok_s_ratio_median_of_rounds": _median(per_round),
            "tokens_per_cpu_s_ratio_per_round": per_round_cpu,
        }
    return out


def _of(runs: list[dict], n: int, round_index: int, what: str) -> float | None:
    """Round ``round_index``'s run at ``n``: its tok/s (``tok_s``) or output tokens per CPU-second."""
    run = next(r for r in runs if r["n"] == n and r["round"] == round_index)
    return run["metrics"]["throughput_tps"] if what == "tok_s" else run["tokens_per_cpu_s"]


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return float(np.median(kept)) if kept else None


def cliff_summary(runs: list[dict]) -> dict:
    """Per rate: mean tok/s, req/s and p50 first token of each case, and each case ÷ fit."""
    out = {}
    names = list(dict.fromkeys(r["case"] for r in runs))
    for rate in sorted({r["rate"] for r in runs}):
        cases = {}
        for case in names:
            mine = [r for r in runs if r["rate"] == rate and r["case"] == case]
            cases[case] = {
                "tok_s": _mean([r["metrics"]["throughput_tps"] for r in mine]),
                "req_s": _mean([r["metrics"]["throughput_rps"] for r in mine]),
                "p50_first_token_s": _mean([r["p50_first_token_s"] for r in mine]),
                "tokens_per_cpu_s": _mean([r["tokens_per_cpu_s"] for r in mine]),
                "mean_running": _mean([r["mean_running"] for r in mine]),
                "slots_full_share": _mean([r.get("slots_full_share") for r in mine]),
            }
        out[f"{rate:g}"] = {**cases}
        for case in names[1:]:
            mine, fit = cases[case], cases["fit"]
            out[f"{rate:g}"][f"{case} / fit"] = {
                "tok_s_ratio": _ratio(mine["tok_s"], fit["tok_s"]),
                "req_s_ratio": _ratio(mine["req_s"], fit["req_s"]),
                "p50_first_token_ratio": _ratio(mine["p50_first_token_s"], fit["p50_first_token_s"]),
                "tokens_per_cpu_s_ratio": _ratio(mine["tokens_per_cpu_s"], fit["tokens_per_cpu_s"]),
            }
    return out


# -- report ----------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    m = results["machine"]
    head = (
        f"{results['bench']} bench, {results['model']} {results['dtype']}, {m['cpu']} ({m['cpus']} CPUs, "
        f"{m['torch_threads']} torch threads), started {results['started']}\n\n"
    )
    rows = [
        (
            "| run | round | requests | adapters named | tok/s | req/s | done | p50 first token "
            "| avg first token | disk reads (s) | page-ins (s) | mean batch (adapters) "
            "| preemptions | tok per CPU-s | CPUs others used | load avg (1 min) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        x, s = r["metrics"], r["system_stats"]
        rows.append(
            f"| {r['label']} | {r['round'] + 1} | {r['requests']} | {r['distinct_adapters']} | "
            f"{x['throughput_tps']:.1f} | {x['throughput_rps']:.2f} | {x['completed']}/{x['requests']} | "
            f"{_s(r['p50_first_token_s'])} | {_s(x['avg_first_token_s'])} | "
            f"{s.get('adapter_fetches', 0)} ({s.get('adapter_fetch_s', 0):.2f}) | "
            f"{s.get('adapter_page_ins', 0)} ({s.get('adapter_page_in_s', 0):.2f}) | "
            f"{r['mean_running']:.1f} ({r['mean_running_adapters']:.1f}) | "
            f"{s.get('preemptions', 0)} | {r['tokens_per_cpu_s'] or 0:.1f} | {r['others_cpus']:.2f} | "
            f"{r['load_avg'][0]:.2f} |"
        )
    return head + "\n".join(rows) + "\n\n```json\n" + json.dumps(results["summary"], indent=1) + "\n```\n"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", choices=("scale", "cliff"))
    parser.add_argument("--quick", action="store_true", help="20 s traces, one round")
    parser.add_argument("--rounds", type=int, help="rounds of runs, alternating their order")
    parser.add_argument("--duration", type=float, help="trace length in seconds")
    parser.add_argument("--rates", type=float, nargs="+", help="cliff: offered loads (req/s)")
    parser.add_argument("--rate", type=float, help="scale: offered load (req/s)")
    parser.add_argument("--alpha", type=float, help="scale: power-law exponent (0: uniform)")
    parser.add_argument("--slots", type=int, help="cliff: adapters the adapter region holds")
    parser.add_argument("--model", default=None, help="base model (default SmolLM2-135M-Instruct)")
    parser.add_argument("--adapters-dir", type=Path, default=DEFAULT_ADAPTER_ROOT)
    parser.add_argument("--out", type=Path, default=default_out("adapter-scale"))
    args = parser.parse_args(argv)
    workload_changes = {k: v for k, v in (("duration_s", args.duration),) if v is not None}
    if args.bench == "scale":
        bench = SCALE_QUICK if args.quick else ScaleBench()
        workload_changes |= {k: v for k, v in (("rate", args.rate), ("alpha", args.alpha)) if v is not None}
        bench = replace(bench, workload=replace(bench.workload, **workload_changes))
        if args.rounds:
            bench = replace(bench, rounds=args.rounds)
        results = run_scale(bench, args.model, args.adapters_dir)
    else:
        bench = CLIFF_QUICK if args.quick else CliffBench()
        bench = replace(bench, workload=replace(bench.workload, **workload_changes))
        changes = {k: v for k, v in (("rounds", args.rounds), ("slots", args.slots)) if v}
        if args.rates:
            changes["rates"] = tuple(args.rates)
        bench = replace(bench, **changes)
        results = run_cliff(bench, args.model, args.adapters_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"{results['bench']}{'-quick' if args.quick else ''}"
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1))
    (args.out / f"{name}.md").write_text(markdown(results))
    print(json.dumps(results["summary"], indent=1))
    print(f"-> {args.out / name}.json, .md")


if __name__ == "__main__":
    main()
