"""The GPU path's host time per decode step, measured on a CPU (issue 55).

    .venv/bin/python -m bench.step_host_time               # batch 1, 32, 256 x 1, 32, 128 adapters
    .venv/bin/python -m bench.step_host_time --quick       # fewer steps

A :class:`~bench.host_only_executor.HostOnlyExecutor` turns each step into the model's inputs
exactly as the worker does before its kernels (token indices, KV write rows, block tables, LoRA
segment tables), placed for SmolLM2-135M's shapes (30 layers, every projection adapted, ranks 8
and 16 alternating), and stops there. The steps are the engine's as a decode batch runs: one
new token per request, the block table's tuple the same object until a block is added, the
adapter slot the same object while its load holds (``AdapterPager.slot``). Request ``i`` uses
adapter ``i mod k``.

Times are the measuring thread's CPU time (``time.thread_time_ns``), not wall-clock: on this
shared 2-vCPU machine other engineers' work deschedules the thread for milliseconds at a time,
which wall-clock would count. PyTorch runs on that one thread (``set_num_threads(1)``).

Host work, not element work. On a GPU a tensor operation costs the host its dispatch (Python
binding, dispatcher, launch), whatever the tensors' sizes; its elements are the device's. On
the CPU the elements are done on the measuring thread too. So the timed steps take turns: one
plain (its thread time), the next under :class:`ElementTimer`, which times each operation's
kernel call and counts the operations; a call's time less one operation's dispatch (the time
inside a call on a one-element tensor, :func:`dispatch_us`, measured at the start) is its
element work. A mode's host figure is

    host = median(thread time) - median(element work)

medians of different steps (the timer's own Python cost per operation is never in the first):
steady where the element work is small beside the host's (steady steps), noisy where it
dominates (churn at batch 256, the step builder: read their thread time). The CUDA launch
itself (a few microseconds an operation) is not in it: the operation counts are there to add
it. ``cpu_us`` is the plain steps' thread time, elements included (how this bench measured
before).

Modes per cell (median microseconds per step):
- ``steady``: no request joins or leaves, each step handed over as what changed
  (:class:`DecodeDelta`: the new tokens, the rows that grew a block); positions staggered, so
  from batch 16 on nearly every step has rows that grow a block;
- ``steady_aligned``: the same, every request at the same position, and only the steps in which
  no row grows a block timed (fifteen in sixteen): the step with nothing but new tokens;
- ``plan_steady``: the same steps as full plans (the engine's interface today), the executor
  finding what changed with whole-list passes in C;
- ``churn``: every step one request leaves and a new one (a new adapter slot) joins (full plans);
- ``builder_steady``, ``builder_churn``: side by side in the same run, the step builder alone
  (the path before issue 55).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Self

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.host_only_executor import HostOnlyExecutor
from bench.out_dir import default_out
from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from bench.worker_bench import machine
from services.gpu_worker.engine.decode_delta import DecodeDelta
from services.gpu_worker.engine.step_plan import AdapterSlot, PlannedRequest, StepPlan
from services.gpu_worker.lora.host_adapter import HostAdapter
from services.gpu_worker.memory.page_allocator import PageUse
from services.model_files.base_model import load_base_model_spec
from services.model_files.peft_format import LORA_TARGETS
from services.runtime.sampling.sampling_params import SamplingParams

BATCHES = (1, 32, 256)
ADAPTER_COUNTS = (1, 32, 128)
RANKS = (8, 16)
BLOCK = 16
CONTEXT = 200
"""Tokens of context each request starts the measured steps with (plus its index mod 64)."""


class ElementTimer(TorchDispatchMode):
    """Counts the tensor operations dispatched inside it (on a GPU, each a kernel launch or a
    host-to-device copy) and sums the thread time spent in their kernel calls."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.inside_ns = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        started = time.thread_time_ns()
        out = func(*args, **(kwargs or {}))
        self.inside_ns += time.thread_time_ns() - started
        return out


class CallCounter:
    """Counts the Python and C function calls made inside it (tensor operations included: each
    is a C call from Python): a steady step's count is what must not grow with the batch."""

    def __init__(self) -> None:
        self.calls = 0

    def __enter__(self) -> Self:
        sys.setprofile(self._count)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)

    def _count(self, frame, event, arg) -> None:
        if event in ("call", "c_call"):
            self.calls += 1


def dispatch_us(calls: int = 4000) -> float:
    """Median microseconds inside one operation's kernel call on a one-element tensor, under
    :class:`ElementTimer`: its dispatch, no elements to speak of."""
    x = torch.zeros(1, dtype=torch.int64)
    inside = []
    for _ in range(calls):
        timer = ElementTimer()
        with timer:
            torch.add(x, 1)
        inside.append(timer.inside_ns)
    return statistics.median(inside) / 1000


@dataclass(frozen=True)
class Mode:
    name: str
    persistent: bool
    """Through the persistent batch (else the step builder alone, the path before)."""
    churn: bool
    """One request leaves and one joins every step."""
    deltas: bool
    """Steady steps handed over as :class:`DecodeDelta` (else full plans)."""
    aligned: bool = False
    """Every request at the same position, and only the steps that grow no block timed."""


MODES = (
    Mode("steady", persistent=True, churn=False, deltas=True),
    Mode("steady_aligned", persistent=True, churn=False, deltas=True, aligned=True),
    Mode("plan_steady", persistent=True, churn=False, deltas=False),
    Mode("churn", persistent=True, churn=True, deltas=False),
    Mode("builder_steady", persistent=False, churn=False, deltas=False),
    Mode("builder_churn", persistent=False, churn=True, deltas=False),
)


@dataclass
class Figures:
    host_us: float
    """Median host work per step: thread time less the operations' element work (the module's
    docstring)."""
    cpu_us: float
    """Median thread time per step, element work included."""
    fastest_cpu_us: float
    ops: int
    """Tensor operations per step (median)."""
    calls: int
    """Python and C function calls per step (median; ``sys.setprofile``): the host's work as a
    count, whatever the machine's load."""


class DecodeBatch:
    """A batch of decoding requests as the engine plans them, step after step."""

    def __init__(self, executor: HostOnlyExecutor, batch: int, adapters: list[str], aligned: bool):
        self.executor = executor
        self.aligned = aligned
        self.adapters = adapters
        self.slots = {a: AdapterSlot(a, executor.residency.get(a).placement) for a in adapters}
        self.layers = executor.view.layout.num_layers
        self.sampling = SamplingParams(max_tokens=1 << 20)
        self.requests: list[dict] = []
        self.grown: list[int] = []
        """Rows that added a block at the last :meth:`advance`."""
        self._joined = 0
        for _ in range(batch):
            self.requests.append(self._new_request())

    def _new_request(self) -> dict:
        index = self._joined
        self._joined += 1
        position = CONTEXT if self.aligned else CONTEXT + index % 64
        blocks = tuple(self._block() for _ in range(-(-(position + 1) // BLOCK)))
        return {
            "id": f"r{index}",
            "adapter": self.adapters[index % len(self.adapters)],
            "pos": position,
            "blocks": blocks,
        }

    def _block(self) -> tuple[int, ...]:
        return tuple(self.executor.pool.allocate(self.layers, PageUse.KV))

    def plan(self) -> StepPlan:
        planned = []
        for r in self.requests:
            planned.append(
                PlannedRequest(
                    request_id=r["id"],
                    token_ids=(r["pos"] % 1000 + 1,),
                    start_position=r["pos"],
                    kv_blocks=r["blocks"],
                    adapter=self.slots[r["adapter"]],
                    sampling=self.sampling,
                )
            )
        return StepPlan(tuple(planned), "auto", False)

    def delta(self) -> DecodeDelta:
        """The step as what changed since the last (no request joined or left): the new tokens
        (the engine's sampled tokens) and the rows that grew a block."""
        requests = self.requests
        grown = tuple((row, requests[row]["blocks"]) for row in self.grown)
        return DecodeDelta(
            [r["pos"] % 1000 + 1 for r in requests], grown, request_ids=[r["id"] for r in requests]
        )

    def advance(self, churn: bool) -> None:
        """Each request's token computed; a block added where the next one needs it."""
        self.grown = []
        for row, r in enumerate(self.requests):
            r["pos"] += 1
            if r["pos"] // BLOCK >= len(r["blocks"]):
                r["blocks"] = (*r["blocks"], self._block())
                self.grown.append(row)
        if churn:
            gone = self.requests.pop(len(self.requests) // 2)
            self.executor.pool.free([p for block in gone["blocks"] for p in block])
            self.requests.append(self._new_request())


def measure(
    executor: HostOnlyExecutor, batch: int, adapters: list[str], steps: int, mode: Mode, dispatch: float
) -> Figures:
    """``steps`` timed decode steps (after warm-up), taking turns: plain, under an
    :class:`ElementTimer`, under a :class:`CallCounter`. Under ``mode.deltas`` steady steps are
    handed over as :class:`DecodeDelta` (the first step is a full plan)."""
    churn, deltas = mode.churn, mode.deltas
    decode = DecodeBatch(executor, batch, adapters, mode.aligned)
    for _ in range(3):
        executor.execute(decode.plan())
        decode.advance(churn)
    totals, elements, ops, calls = [], [], [], []
    i = 0
    while i < steps:
        # The plan or delta is the engine's work, not the executor's: made outside the timer.
        step = decode.delta() if deltas else decode.plan()
        run = executor.execute_decode if deltas else executor.execute
        # (a delta's rows are the executor's: its step is never declined here)
        if mode.aligned and decode.grown:
            run(step)  # a step that grows blocks: not one of the aligned mode's
            decode.advance(churn)
            continue
        if i % 3 == 2:
            with CallCounter() as counter:
                run(step)
            calls.append(counter.calls)
        elif i % 3 == 1:
            timer = ElementTimer()
            with timer:
                run(step)
            # Each operation keeps its dispatch: the rest of its kernel call is its elements.
            elements.append(timer.inside_ns / 1000 - timer.ops * dispatch)
            ops.append(timer.ops)
        else:
            started = time.thread_time_ns()
            run(step)
            totals.append((time.thread_time_ns() - started) / 1000)
        decode.advance(churn)
        i += 1
    for r in decode.requests:
        executor.pool.free([p for block in r["blocks"] for p in block])
    median = statistics.median
    return Figures(
        round(median(totals) - median(elements), 1),
        round(median(totals), 1),
        round(min(totals), 1),
        round(median(ops)),
        round(median(calls)),
    )


def sample_adapters(spec, root: Path) -> list[HostAdapter]:
    """One adapter per rank of :data:`RANKS`, every projection of every layer adapted."""
    out = []
    for rank in RANKS:
        directory = write_peft_adapter(
            root / f"r{rank}", spec, SampleAdapterSpec(rank=rank, target_modules=LORA_TARGETS, seed=rank)
        )
        out.append(read_peft_directory(f"r{rank}", directory, torch.bfloat16))
    return out


def run(steps: int, modes: set[str]) -> tuple[list[dict], float]:
    spec = load_base_model_spec()
    config = spec
    layers = config.num_layers
    page_elems = 2 * BLOCK * config.num_kv_heads * config.head_dim
    with tempfile.TemporaryDirectory() as tmp:
        samples = sample_adapters(spec, Path(tmp))
    adapter_pages = sum(
        -(-sum(f.a.numel() + f.b_t.numel() for f in a.modules.values()) // page_elems) for a in samples
    )
    kv_pages = max(BATCHES) * 2 * (-(-(CONTEXT + 64 + steps + 8) // BLOCK)) * layers
    executor = HostOnlyExecutor(config, adapter_pages * max(ADAPTER_COUNTS) + kv_pages, BLOCK)
    ids = [f"adapter-{i}" for i in range(max(ADAPTER_COUNTS))]
    for i, adapter_id in enumerate(ids):
        executor.place(samples[i % len(samples)], adapter_id)
    dispatch = dispatch_us()
    print(f"dispatch of one operation: {dispatch:.2f} us", flush=True)
    cells = []
    for batch in BATCHES:
        for k in ADAPTER_COUNTS:
            cell: dict = {"batch": batch, "adapters": k}
            for mode in MODES:
                if mode.name not in modes:
                    continue
                executor.persistent = mode.persistent
                cell[mode.name] = asdict(measure(executor, batch, ids[:k], steps, mode, dispatch))
            cell["load_average"] = round(os.getloadavg()[0], 2)
            cells.append(cell)
            print(
                f"batch {batch:>3} adapters {k:>3}: "
                + "  ".join(
                    f"{m.name} {cell[m.name]['host_us']:.1f} us (cpu {cell[m.name]['cpu_us']:.1f})"
                    f" {cell[m.name]['ops']} ops {cell[m.name]['calls']} calls"
                    for m in MODES
                    if m.name in modes
                )
                + f"  load {cell['load_average']}",
                flush=True,
            )
    return cells, dispatch


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="timed decode steps per cell")
    parser.add_argument(
        "--modes",
        default=",".join(m.name for m in MODES),
        help="comma-separated modes to measure (a tree before the delta interface has no 'steady')",
    )
    parser.add_argument("--quick", action="store_true", help="12 timed steps per cell")
    parser.add_argument("--out", type=Path, default=default_out("step_host_time"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # the host work is one thread's; keep the other cores' noise out
    load = os.getloadavg()
    cells, dispatch = run(18 if args.quick else args.steps, set(args.modes.split(",")))
    write_results(args.out, load, cells, dispatch_us=dispatch)


def write_results(out: Path, load_before: tuple[float, float, float], cells: list[dict], **extra) -> None:
    """``out/results.json``: the machine, the load averages before and now, ``extra``, the cells."""
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": machine(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        **extra,
        "cells": cells,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"load average before {load_before}, after {result['load_average_after']}; {out / 'results.json'}")


if __name__ == "__main__":
    main()
