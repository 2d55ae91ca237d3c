"""The engine's whole step on the host, kernels left out: what a GPU worker's step costs its CPU.

    .venv/bin/python -m bench.engine_host_time              # batch 1, 32, 256 x 1, 32, 128 adapters
    .venv/bin/python -m bench.engine_host_time --quick

``bench.step_host_time`` times the executor's part of a decode step (the plan into the model's
inputs). Around it the engine plans the step (batch policy, KV reservation, adapter slots, the
plan or the delta), samples and sends each request's token. This runs a real
:class:`~services.gpu_worker.engine.engine.Engine` over a
:class:`~bench.host_only_executor.HostOnlyEngineExecutor` (the GPU path's input building, then
fixed logits in place of the model's), SmolLM2-135M's shapes with a 64-token vocabulary (so
sampling's element work, a GPU's, stays small), greedy requests that never stop, request ``i``
on adapter ``i mod k``. Every request decodes in every timed step; none joins or leaves.

Two modes side by side in each cell: ``deltas`` (steady steps handed to the executor as
:class:`DecodeDelta`, the engine's default where the executor takes them) and ``plans`` (the
executor declines deltas: a :class:`StepPlan` every step, as before). Figures: median thread CPU
time of a step (``time.thread_time_ns``; PyTorch on one thread), and Python/C function calls
per step (``sys.setprofile``), the load-independent measure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.host_only_executor import HostOnlyEngineExecutor, HostOnlyExecutor
from bench.out_dir import default_out
from bench.step_host_time import (
    ADAPTER_COUNTS,
    BATCHES,
    BLOCK,
    CONTEXT,
    CallCounter,
    sample_adapters,
    write_results,
)
from bench.systems.llamacpp_adapters import converter_base_config
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.model_files.base_model import load_base_model_spec
from services.model_files.model_config import ModelConfig

VOCAB = 64


def model_config() -> ModelConfig:
    """SmolLM2-135M's dimensions with a :data:`VOCAB`-token vocabulary."""
    hf_config = converter_base_config(load_base_model_spec())
    return ModelConfig.from_hf_config(
        {**hf_config, "vocab_size": VOCAB, "max_position_embeddings": 8192}, "smollm2-shapes"
    )


def measure(config: ModelConfig, adapters: list, batch: int, k: int, steps: int, deltas: bool) -> dict:
    kv_pages = batch * (-(-(CONTEXT + 64 + steps + 16) // BLOCK)) * config.num_layers
    adapter_pages = 40_000 if k > 1 else 1_000
    host = HostOnlyExecutor(config, kv_pages + adapter_pages * max(1, k // 16), BLOCK)
    executor = HostOnlyEngineExecutor(host, config, deltas=deltas)
    engine = Engine(
        executor,
        EngineConfig(
            kv_block_tokens=BLOCK,
            max_running=batch,
            max_prefill_tokens=(CONTEXT + 64) * batch,
            lora_backend="triton",  # resolved by name: the persistent path's backend
        ),
    )
    for i in range(k):
        engine.add_adapter(replace(adapters[i % len(adapters)], adapter_id=f"adapter-{i}"))
    sampling = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    for i in range(batch):
        prompt = tuple((7 * i + j) % (VOCAB - 1) + 1 for j in range(CONTEXT + i % 64))
        engine.submit(GenerationRequest(f"r{i}", prompt, sampling, f"adapter-{i % k}"), lambda event: None)
    while engine.steps < 8 or len(engine.running) < batch:
        engine.step()
    times, calls = [], []
    for i in range(steps):
        if i % 4 == 3:
            with CallCounter() as counter:
                engine.step()
            calls.append(counter.calls)
            continue
        started = time.thread_time_ns()
        stepped = engine.step()
        times.append((time.thread_time_ns() - started) / 1000)
        assert stepped == batch, f"{stepped} of {batch} requests stepped"
    return {
        "step_us": round(statistics.median(times), 1),
        "fastest_us": round(min(times), 1),
        "calls": round(statistics.median(calls)),
        "deltas": engine.steady.deltas,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200, help="timed steps per cell and mode")
    parser.add_argument("--quick", action="store_true", help="40 timed steps per cell")
    parser.add_argument("--out", type=Path, default=default_out("engine_host_time"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = 40 if args.quick else args.steps
    config = model_config()
    with tempfile.TemporaryDirectory() as tmp:
        adapters = sample_adapters(load_base_model_spec(), Path(tmp))
    load = os.getloadavg()
    cells = []
    for batch in BATCHES:
        for k in ADAPTER_COUNTS:
            cell = {"batch": batch, "adapters": k}
            for mode, deltas in (("deltas", True), ("plans", False)):
                cell[mode] = measure(config, adapters, batch, k, steps, deltas)
            cell["load_average"] = round(os.getloadavg()[0], 2)
            cells.append(cell)
            print(
                f"batch {batch:>3} adapters {k:>3}: "
                + "  ".join(
                    f"{m} {cell[m]['step_us']:.0f} us (fastest {cell[m]['fastest_us']:.0f}) {cell[m]['calls']} calls"
                    for m in ("deltas", "plans")
                )
                + f"  load {cell['load_average']}",
                flush=True,
            )
    write_results(args.out, load, cells)


if __name__ == "__main__":
    main()
