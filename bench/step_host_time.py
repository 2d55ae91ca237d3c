"""The GPU path's host time per decode step, measured on a CPU (issue 55).

    .venv/bin/python -m bench.step_host_time               # batch 1, 32, 256 x 1, 32, 128 adapters
    .venv/bin/python -m bench.step_host_time --quick       # fewer steps

A :class:`~bench.host_only_executor.HostOnlyExecutor` turns each step's plan into the model's
inputs exactly as the worker does before its kernels (token indices, KV write rows, block tables,
LoRA segment tables), placed for SmolLM2-135M's shapes (30 layers, every projection adapted,
ranks 8 and 16 alternating), and stops there. The plans are the engine's as a decode batch
runs: every step a new :class:`PlannedRequest` per request, one new token each, a new
:class:`AdapterSlot` object per request (equal to the last), the block table's tuple the same
object until a block is added. Request ``i`` uses adapter ``i mod k``.

Times are the measuring thread's CPU time (``time.thread_time_ns``), not wall-clock: on this
shared 2-vCPU machine other engineers' work deschedules the thread for milliseconds at a time,
which wall-clock would count. PyTorch runs on that one thread here (``set_num_threads(1)``), so
the small tensor operations a GPU would run as kernels (gathers of block tables, masks, the LoRA
tables' packing) are counted too: an upper bound of the host's share. The tensor operations of
a step are counted as well (each a kernel launch or a copy on a GPU).

Two figures per cell, median microseconds of host work per step:
- ``steady``: no request joins or leaves (what must be flat in the batch size);
- ``churn``: every step one request leaves and a new one (a new adapter slot) joins;
each through the GPU path (persistent batch, device LoRA tables) and, side by side in the same
run, through the step builder alone (the path before issue 55).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.host_only_executor import HostOnlyExecutor
from bench.out_dir import default_out
from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from bench.worker_bench import machine
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


class OpCounter(TorchDispatchMode):
    """Counts the tensor operations dispatched inside it: on a GPU, each is a kernel launch (or a
    host-to-device copy) the host makes, however small the tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@dataclass
class Cell:
    batch: int
    adapters: int
    steady_us: float
    churn_us: float
    builder_steady_us: float
    """The same steps through the step builder alone (the path before issue 55)."""
    builder_churn_us: float
    steady_min_us: float
    """The fastest steady step: the least disturbed by other processes' use of the caches."""
    steady_ops: int
    """Tensor operations of one steady step (kernel launches and copies on a GPU)."""
    churn_ops: int
    builder_steady_ops: int
    builder_churn_ops: int


class DecodeBatch:
    """A batch of decoding requests as the engine plans them, step after step."""

    def __init__(self, executor: HostOnlyExecutor, batch: int, adapters: list[str]):
        self.executor = executor
        self.adapters = adapters
        self.layers = executor.view.layout.num_layers
        self.sampling = SamplingParams(max_tokens=1 << 20)
        self.requests: list[dict] = []
        self._joined = 0
        for _ in range(batch):
            self.requests.append(self._new_request())

    def _new_request(self) -> dict:
        index = self._joined
        self._joined += 1
        position = CONTEXT + index % 64
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
            placement = self.executor.residency.get(r["adapter"]).placement
            planned.append(
                PlannedRequest(
                    request_id=r["id"],
                    token_ids=(r["pos"] % 1000 + 1,),
                    start_position=r["pos"],
                    kv_blocks=r["blocks"],
                    adapter=AdapterSlot(r["adapter"], placement),
                    sampling=self.sampling,
                )
            )
        return StepPlan(tuple(planned), "auto", False)

    def advance(self, churn: bool) -> None:
        """Each request's token computed; a block added where the next one needs it."""
        for r in self.requests:
            r["pos"] += 1
            if r["pos"] // BLOCK >= len(r["blocks"]):
                r["blocks"] = (*r["blocks"], self._block())
        if churn:
            gone = self.requests.pop(len(self.requests) // 2)
            self.executor.pool.free([p for block in gone["blocks"] for p in block])
            self.requests.append(self._new_request())


def measure(
    executor: HostOnlyExecutor, batch: int, adapters: list[str], steps: int, churn: bool
) -> tuple[float, float, int]:
    """Median microseconds of ``executor.execute``'s thread CPU time over ``steps`` decode steps
    (after warm-up), the fastest of them, and the tensor operations of one more step."""
    decode = DecodeBatch(executor, batch, adapters)
    for _ in range(3):
        executor.execute(decode.plan())
        decode.advance(churn)
    times = []
    for _ in range(steps):
        plan = decode.plan()  # the engine's work, not the executor's: outside the timer
        started = time.thread_time_ns()
        executor.execute(plan)
        times.append(time.thread_time_ns() - started)
        decode.advance(churn)
    counter = OpCounter()
    with counter:
        executor.execute(decode.plan())
    for r in decode.requests:
        executor.pool.free([p for block in r["blocks"] for p in block])
    return statistics.median(times) / 1000, min(times) / 1000, counter.ops


def sample_adapters(spec, root: Path) -> list[HostAdapter]:
    """One adapter per rank of :data:`RANKS`, every projection of every layer adapted."""
    out = []
    for rank in RANKS:
        directory = write_peft_adapter(
            root / f"r{rank}", spec, SampleAdapterSpec(rank=rank, target_modules=LORA_TARGETS, seed=rank)
        )
        out.append(read_peft_directory(f"r{rank}", directory, torch.bfloat16))
    return out


def run(steps: int) -> list[Cell]:
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
    cells = []
    for batch in BATCHES:
        for k in ADAPTER_COUNTS:
            figures, ops = [], []
            for persistent in (True, False):
                executor.persistent = persistent
                for churn in (False, True):
                    us, fastest, count = measure(executor, batch, ids[:k], steps, churn)
                    figures.append(round(us, 1))
                    ops.append(count)
                    if persistent and not churn:
                        steady_min = round(fastest, 1)
            cells.append(Cell(batch, k, *figures, steady_min, *ops))
            print(
                f"batch {batch:>3} adapters {k:>3}: steady {figures[0]:8.1f} us (min {steady_min:7.1f})"
                f" {ops[0]:>4} ops  churn {figures[1]:8.1f} us {ops[1]:>4} ops"
                f"  | step builder: steady {figures[2]:8.1f} us {ops[2]:>5} ops"
                f"  churn {figures[3]:8.1f} us {ops[3]:>5} ops",
                flush=True,
            )
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60, help="timed decode steps per cell")
    parser.add_argument("--quick", action="store_true", help="12 timed steps per cell")
    parser.add_argument("--out", type=Path, default=default_out("step_host_time"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # the host work is one thread's; keep the other cores' noise out
    load = os.getloadavg()
    cells = run(12 if args.quick else args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": machine(),
        "load_average_before": load,
        "load_average_after": os.getloadavg(),
        "cells": [asdict(c) for c in cells],
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"load average before {load}, after {result['load_average_after']}; {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
