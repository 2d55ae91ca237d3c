"""Each measurement of ``loramesh bench`` in a fresh process of its own, with the torch thread
settings it is given, and the machine's load recorded beside it.

Why a process per run: the bench used to run every system one after the other in one process,
so a run inherited whatever the runs before it left behind (torch's thread settings, threads
with OpenMP teams, caches). ``bench.peft_collapse_probe`` measured that inheritance for the PEFT
baseline and found none (same settings, same threads, same step time after an engine run). What
it found instead: with 2 threads on this 2-CPU machine, every op of a small-batch step ends at an
OpenMP barrier whose waiting thread spins (libgomp's default while a process's teams fit the
CPUs), and when another process holds a core the spinning burns the time slice the other thread
needs: 4.4× the step time and 4-6× the CPU seconds per step of the same process with
``OMP_WAIT_POLICY=PASSIVE``, or of 1 thread. The old single process hid this from the engine
only: its main thread and engine thread each had a team, more threads than CPUs, so libgomp
throttled the spinning there (as a worker's engine never is: services/gpu_worker/engine/
side_threads.py). So each run now starts from the same state, the engine's runs with their main
thread confined as a worker's event loop is (``bench.serving.runner``), every run records how
much of the CPUs other processes used, and the report quotes no ratio over a loaded run
(:func:`loaded`).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
"""How OpenMP threads wait at a barrier: unset, libgomp spins a while first (as ``loramesh up``'s
worker runs); ``passive`` sleeps at once, which a loaded machine needs (see above). Set for
``loramesh bench`` in its environment: every run's process inherits it and records it."""
LOADED_SHARE = 0.10
"""A run is loaded when other processes used more than this share of the machine's CPUs during
it: its figures are kept but no ratio is quoted over it."""


@dataclass(frozen=True)
class RunThreads:
    """The torch thread settings a run's process starts with (set before its first torch op)."""

    intra_op: int
    """``torch.set_num_threads``: the OpenMP team of every op (``loramesh up`` gives its one
    worker one per CPU: loramesh_cli/mesh_layout.py)."""
    inter_op: int
    """``torch.set_num_interop_threads``: the pool that runs independent ops in parallel."""

    @classmethod
    def per_cpu(cls) -> RunThreads:
        """One thread per CPU for both, as ``loramesh up``'s worker and torch's defaults."""
        cpus = os.cpu_count() or 1
        return cls(intra_op=cpus, inter_op=cpus)


def thread_settings() -> dict[str, int | str]:
    """The torch thread settings in force in this process, and how its OpenMP threads wait
    (``OMP_WAIT_POLICY``, inherited from the bench's environment: ``default`` when unset)."""
    import torch

    return {
        "intra_op": torch.get_num_threads(),
        "inter_op": torch.get_num_interop_threads(),
        "omp_wait_policy": os.environ.get(WAIT_POLICY_ENV, "") or "default",
    }


def run_isolated(target: Callable[..., Any], args: tuple, threads: RunThreads) -> dict:
    """``target(*args)`` in a fresh (spawned) process that set ``threads`` first; returns
    ``{"result": ..., "threads": the settings it ran with, "load": ...}`` (see :func:`_call`).
    The target and its arguments must pickle; its exceptions are raised here."""
    with ProcessPoolExecutor(
        max_workers=1,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_apply,
        initargs=(threads,),
    ) as pool:
        return pool.submit(_call, target, args).result()


def loaded(run: dict) -> bool:
    """Whether other processes used more than :data:`LOADED_SHARE` of the CPUs during ``run``
    (a result of :func:`run_isolated`; runs recorded before the load was are not judged)."""
    share = run.get("load", {}).get("others_cpu_share")
    return share is not None and share > LOADED_SHARE


def _apply(threads: RunThreads) -> None:
    import torch

    torch.set_num_threads(threads.intra_op)
    torch.set_num_interop_threads(threads.inter_op)


def _call(target: Callable[..., Any], args: tuple) -> dict:
    from bench.worker_bench import CpuMonitor

    settings = thread_settings()
    before = os.getloadavg()[0]
    monitor = CpuMonitor()
    result = target(*args)
    return {
        "result": result,
        "threads": settings,
        "load": {
            "others_cpu_share": round(monitor.tick(), 3),
            "load_1min_before": round(before, 2),
            "load_1min_after": round(os.getloadavg()[0], 2),
        },
    }
