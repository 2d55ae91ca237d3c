"""Simulator vs real engines on one or two workers: the same trace, throughput and mean latency.

The real side is the in-process engine replay of ``bench/systems/engine_system.py`` (the worker's
request path without gRPC: adapters read from disk on demand, wall clock); the simulated side is
:class:`ClusterSimulator` with as many workers and the calibration's cost model and adapter load
time. Error = (simulated − measured) / measured. The real side's figures move with whatever else
runs on the machine; record the load next to them.

With ``--workers 2`` each real worker is its own process (spawned; one torch thread, as
calibrated and as a gpu_worker started with ``--threads 1``), so the two engines run in parallel
on the machine's two cores with no shared interpreter lock between them, as two gpu_workers on
one host would; they do share the caches and memory bandwidth, and the cores with whatever else
runs there. Each process replays its share of the trace with its own engine, adapter loader and
64 MiB host cache, reading the same adapter directory. The shares come from replaying the
placement policy — the simulator's own class, a fresh :class:`RoundRobin` on each side — over a
cluster view with the simulator's worker ids; round-robin ignores load, so the placement does not
depend on timing and both sides put every request on the same worker (checked). The processes
meet at a barrier, then each loads its model and starts its clock; each reports its clock's
start (``time.monotonic`` is system-wide; read from the replay's first pool sample, so the engine's
stats are also read every 0.25 s, as a worker's load reports do) so the two runs go on one
timeline, and the skew between the starts is reported. Load-aware placement (least-estimated-wait) would need the
requests to go through one scheduler at run time: that is the mesh, not this replay.

The calibration keeps each step's *fastest* of three runs (the engine's own cost), while a replay
on a shared machine meets the typical, contended step; near saturation that gap decides the
queueing. So the run also records every real step (tokens, adapters, seconds from its start to
the next plan: the forward pass, sampling, emitting), reports measured over calibrated step time, and ``--step-fit`` simulates with a model
fitted on another run's recorded steps (e.g. the 60% run's, to predict the 90% run: the same
machine under the same kind of load, fitted out of sample); ``--measured`` reuses an earlier
run's real side instead of replaying again. With two workers each one's steps are kept apart
(``real_steps`` maps a worker id to its steps) and the ratio is given per worker; ``--step-fit``
fits one model on all of them pooled, since the simulator gives every worker the same model.

A calibration of bare engine steps underestimates a serving step (the replay's engine shares its
process with the event loop and the adapter loader), so the validated procedure is a *serving
calibration*: ``--save-step-fit`` writes the ``--step-fit`` model as a calibration file, and
later runs given it as ``--calibration`` size their traces by the capacity serving measured and
are simulated with a step model fitted on another run (bench/HISTORY.md, "On a quiet machine").

    .venv/bin/python -m bench.cluster_sim.validate --out bench/out/cluster_sim/validation.json
    .venv/bin/python -m bench.cluster_sim.validate --load 0.9 --duration 90 \
        --step-fit bench/out/cluster_sim/validation.json --out bench/out/cluster_sim/validation_load90.json
    .venv/bin/python -m bench.cluster_sim.validate --workers 2 --duration 90 --out bench/out/cluster_sim/validation_2w.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing.managers import BarrierProxy
from pathlib import Path

import numpy as np
import torch

from bench.cluster_sim.calibrate import cpu_model, fit
from bench.cluster_sim.cost_model import DEFAULT_CALIBRATION, SHAPE_TERMS, Calibration, StepShape
from bench.cluster_sim.experiment import capacity_rps
from bench.cluster_sim.simulator import ClusterSimulator, SimConfig
from bench.cluster_sim.worker import WorkerSpec
from bench.out_dir import default_out
from bench.serving.adapters import ensure_adapter_set
from bench.systems.base import AdapterSet, RequestRecord, RunContext
from bench.systems.engine_system import EngineSystem, EngineSystemOptions
from bench.workload import TraceRequest, WorkloadSpec, generate
from services.gpu_worker.engine.policies.batch_policy import BatchPlan, BatchView, StepOutcome
from services.gpu_worker.engine.policies.fcfs import Fcfs
from services.gpu_worker.engine.policies.linear_cost import LinearCost
from services.model_files.base_model import load_base_model_spec
from services.scheduler.cluster_view import ClusterView
from services.scheduler.placement import PlacementRequest
from services.scheduler.policies.interface import PlacementPolicy
from services.scheduler.policies.round_robin import RoundRobin

INPUT_RANGE = (8, 64)
OUTPUT_RANGE = (8, 64)
RANKS = (8, 64)
MAX_BATCH = 16
POOL_MIB = 256
HOST_CACHE_MIB = 64
IDLE_GAP_S = 0.05
"""A pause longer than this between a step's end and the next plan is idling, not overhead."""
KV_TOKEN_BYTES = 30 * 2 * 3 * 64 * 4
"""SmolLM2-135M's KV per token in fp32 (30 layers, K and V, 3 KV heads of 64): the unit of the
simulated pool and host cache (a rank-r adapter on q/k/v/o is 10·r of them)."""


def figures(arrivals, finishes) -> dict:
    """Completed requests per second (first arrival to last finish) and mean latency."""
    done = [(a, f) for a, f in zip(arrivals, finishes, strict=True) if f is not None]
    span = max(f for _, f in done) - min(arrivals)
    return {"completed": len(done), "throughput_rps": len(done) / span,
            "mean_latency_s": float(np.mean([f - a for a, f in done]))}  # fmt: skip


class RecordingFcfs(Fcfs):
    """The engine's default FCFS policy, keeping what every step cost: from planning it (then
    admitting, building the batch, the forward pass, sampling, emitting) to planning the next,
    unless the engine idled in between."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, float]] = []
        """(tokens computed, distinct adapters, seconds) per step."""
        self._started = 0.0
        self._ended: float | None = None
        self._shape = (0, 0)

    def plan(self, view: BatchView) -> BatchPlan:
        now = time.monotonic()
        if self._ended is not None:
            # A long gap after a step is the engine idling for arrivals, not the step's work.
            end = now if now - self._ended < IDLE_GAP_S else self._ended
            self.steps.append((*self._shape, end - self._started))
            self._ended = None
        self._started = now
        return super().plan(view)

    def observe(self, outcome: StepOutcome) -> None:
        self._ended = time.monotonic()
        self._shape = (outcome.prefill_tokens + outcome.decode_tokens, outcome.adapters)


def step_shape(tokens: int, adapters: int) -> StepShape:
    """A recorded step's shape; its ranks are not recorded, so every token gets the mean rank."""
    return StepShape(tokens, adapters, int(tokens * sum(RANKS) / len(RANKS)), 0.0)


def fit_steps(steps: list[list[float]]) -> tuple[LinearCost, float]:
    """The step-cost model fitted on a validation run's recorded steps (see the module docstring)."""
    return fit([(step_shape(int(t), int(a)), 1000.0 * s) for t, a, s in steps])


def step_model_ratio(model: LinearCost, steps: list[list[float]]) -> float:
    """Mean of measured over predicted step time."""
    return float(np.mean([1000.0 * s / model.predict(step_shape(int(t), int(a)).row()) for t, a, s in steps]))


def steps_by_worker(result: dict) -> dict[str, list[list[float]]]:
    """A result's recorded steps per worker id; a one-worker result from before two-worker runs
    keeps a plain list, the simulator's only worker's."""
    steps = result["real_steps"]
    return steps if isinstance(steps, dict) else {worker_ids(1)[0]: steps}


def pooled(steps: dict[str, list[list[float]]]) -> list[list[float]]:
    return [step for worker in sorted(steps) for step in steps[worker]]


def worker_ids(workers: int) -> list[str]:
    """The simulated workers' ids, as :class:`ClusterSimulator` names them."""
    return list(
        ClusterSimulator(SimConfig(workers=workers), LinearCost.named(SHAPE_TERMS), RoundRobin()).workers
    )


def place(trace: list[TraceRequest], workers: int, policy: PlacementPolicy) -> list[str]:
    """The worker ``policy`` puts each request on, placing them in trace order over a view of
    the simulator's workers with no load reports (a load-blind policy decides as in the
    simulator)."""
    view = ClusterView(clock=lambda: 0.0)
    view.update_members({w: f"real:{w}" for w in worker_ids(workers)})
    chosen = []
    for r in trace:
        wanted = PlacementRequest(request_id=r.request_id, adapter_id=f"a{r.adapter}",
                                  prompt_tokens=r.input_len, max_tokens=r.output_len)  # fmt: skip
        worker = policy.place(view.snapshot(), wanted).worker_id
        view.record_placement(worker, wanted.adapter_id)
        chosen.append(worker)
    return chosen


@dataclass
class Share:
    """One real worker's replay of its share of the trace."""

    records: list[RequestRecord]
    steps: list[tuple[int, int, float]]
    start: float
    """``time.monotonic()`` when its clock started (system-wide, comparable across processes)."""

    def timeline(self, origin: float) -> tuple[list[float], list[float | None]]:
        """Arrivals and finishes on a timeline starting at ``origin``."""
        shift = self.start - origin
        return ([r.arrival_s + shift for r in self.records],
                [None if r.finish_s is None else r.finish_s + shift for r in self.records])  # fmt: skip


def replay_share(
    trace: list[TraceRequest], adapters: AdapterSet, barrier: BarrierProxy | None = None
) -> Share:
    """Replay ``trace`` on one real engine (one torch thread, as calibrated), after ``barrier``."""
    torch.set_num_threads(1)
    recorder = RecordingFcfs()
    starts: list[float] = []

    def first_sample(since_start_s: float, _stats: dict) -> None:
        if not starts:
            starts.append(time.monotonic() - since_start_s)

    context = RunContext(trace=trace, adapters=adapters, window_s=math.inf, max_batch=MAX_BATCH,
                         pool_mib=POOL_MIB, host_cache_mib=HOST_CACHE_MIB, on_sample=first_sample)  # fmt: skip
    if barrier is not None:
        barrier.wait()
    records = EngineSystem(EngineSystemOptions(batch_policy=lambda: recorder)).run(context)
    return Share(records, recorder.steps, starts[0])


def replay(trace: list[TraceRequest], placement: list[str], adapters: AdapterSet) -> dict[str, Share]:
    """Every worker's share replayed at once, one process per worker when there are several."""
    shares = {w: [r for r, p in zip(trace, placement, strict=True) if p == w] for w in sorted(set(placement))}
    if len(shares) == 1:
        return {w: replay_share(t, adapters) for w, t in shares.items()}
    spawn = multiprocessing.get_context("spawn")
    with spawn.Manager() as manager, ProcessPoolExecutor(len(shares), mp_context=spawn) as pool:
        barrier = manager.Barrier(len(shares))
        futures = {w: pool.submit(replay_share, t, adapters, barrier) for w, t in shares.items()}
        return {w: f.result() for w, f in futures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", default=str(DEFAULT_CALIBRATION))
    parser.add_argument("--workers", type=int, default=1, choices=(1, 2))
    parser.add_argument("--load", type=float, default=0.6, help="offered load / estimated capacity")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--out", default=str(default_out("cluster_sim") / "validation.json"))
    parser.add_argument("--measured", help="take the real side (and its steps) from this earlier result")
    parser.add_argument(
        "--step-fit", help="simulate with a step model fitted on this result's recorded steps"
    )
    parser.add_argument(
        "--sim-calibration",
        help="simulate with this calibration's step model and adapter load time; the trace's rate "
        "still comes from --calibration (so a --measured run keeps its trace)",
    )
    parser.add_argument(
        "--save-step-fit",
        help="also write the --step-fit model as a calibration file (adapter load time from the "
        "simulating calibration), to size later runs' traces by the capacity serving measured",
    )
    args = parser.parse_args()
    if args.save_step_fit and not args.step_fit:
        parser.error("--save-step-fit needs --step-fit")
    torch.set_num_threads(1)  # as calibrated
    calibration = Calibration.load(args.calibration)
    simulated_with = Calibration.load(args.sim_calibration) if args.sim_calibration else calibration
    spec = WorkerSpec(
        max_running=MAX_BATCH,
        memory_tokens=POOL_MIB * 2**20 // KV_TOKEN_BYTES,
        adapter_load_ms=simulated_with.adapter_load_ms,
        host_cache_tokens=HOST_CACHE_MIB * 2**20 // KV_TOKEN_BYTES,
    )
    capacity = args.workers * capacity_rps(calibration.model, spec, INPUT_RANGE, OUTPUT_RANGE, RANKS)
    rate = args.load * capacity
    trace = generate(WorkloadSpec(adapters=8, alpha=1.0, rate=rate, cv=1.0, input_range=INPUT_RANGE,
                                  output_range=OUTPUT_RANGE, ranks=RANKS, duration_s=args.duration))  # fmt: skip
    model, fitted_on = simulated_with.model, args.sim_calibration or args.calibration
    if args.step_fit:
        fitted_steps = pooled(steps_by_worker(json.loads(Path(args.step_fit).read_text())))
        model, fit_error = fit_steps(fitted_steps)
        fitted_on = f"{args.step_fit} (fit error {fit_error:.0f}%)"
        if args.save_step_fit:
            Calibration(model, simulated_with.adapter_load_ms, cpu_model(), len(fitted_steps),
                        fit_error).save(args.save_step_fit)  # fmt: skip
    simulator = ClusterSimulator(SimConfig(workers=args.workers, worker=spec), model, RoundRobin())
    simulated = simulator.run(trace)
    placement = place(trace, args.workers, RoundRobin())
    assert placement == [r.worker for r in simulated.requests], "the two sides placed differently"
    sim_by_worker = {w: figures(*zip(*[(r.arrival_s, r.finish_s) for r in simulated.requests if r.worker == w]))
                     for w in sorted(set(placement))}  # fmt: skip
    sim = figures([r.arrival_s for r in simulated.requests], [r.finish_s for r in simulated.requests])
    if args.measured:
        earlier = json.loads(Path(args.measured).read_text())
        real, real_by_worker = earlier["measured"], earlier.get("measured_by_worker")
        steps, skew = steps_by_worker(earlier), earlier.get("start_skew_s")
        load = [earlier.get("load_average_start"), earlier["load_average"]]
    else:
        load_start = os.getloadavg()
        with tempfile.TemporaryDirectory() as tmp:
            adapters = ensure_adapter_set(Path(tmp), load_base_model_spec(), 8, RANKS)
            shares = replay(trace, placement, adapters)
        load = [load_start, os.getloadavg()]
        origin = min(s.start for s in shares.values())
        timelines = {w: s.timeline(origin) for w, s in shares.items()}
        real = figures(*[[t for w in timelines for t in timelines[w][side]] for side in (0, 1)])
        real_by_worker = {w: figures(*t) for w, t in timelines.items()}
        steps, skew = {w: s.steps for w, s in shares.items()}, max(s.start for s in shares.values()) - origin
    error = {k: (sim[k] - real[k]) / real[k] for k in ("throughput_rps", "mean_latency_s")}
    result = {"workers": args.workers, "requests": len(trace), "rate_rps": rate, "measured": real,
              "simulated": sim, "error": error, "measured_by_worker": real_by_worker,
              "simulated_by_worker": sim_by_worker, "start_skew_s": skew,
              "step_model": model.as_dict(), "step_model_from": fitted_on,
              "measured_over_calibrated_step": step_model_ratio(simulated_with.model, pooled(steps)),
              "measured_over_calibrated_step_by_worker":
                  {w: step_model_ratio(simulated_with.model, s) for w, s in steps.items()},
              "calibration_cpu_model": calibration.cpu_model, "cpu_model": cpu_model(),
              "load_average_start": load[0], "load_average": load[1], "real_steps": steps}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "real_steps"}, indent=1))


if __name__ == "__main__":
    main()
