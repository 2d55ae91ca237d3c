"""Fit the simulator's step-cost model on the real engine (SmolLM2-135M) and measure adapter loads.

For a grid of batch shapes (requests, prompt length, distinct adapters, rank) it submits the
requests to a real :class:`~services.gpu_worker.engine.engine.Engine`, times the prefill step
and a few decode steps with ``perf_counter``, records each step's :class:`StepShape`, and fits
the step-cost model (:class:`LinearCost` over ``SHAPE_TERMS``) by non-negative least squares (no
coefficient is negative, so the model never predicts cheaper work as slower; the committed
calibrations were fitted by dropping a negative coefficient and refitting the rest, which gives
the same fit, up to rounding, when at most one comes out negative, as in each of them).
Adapter load time is the median of reading a PEFT adapter from disk (page cache dropped first),
parsing it and paging it into the pool: what a worker does after the store's bytes arrive, minus
the network.

    .venv/bin/python -m bench.cluster_sim.calibrate --out bench/out/cluster_sim/calibration.json

The simulations read the committed calibrations of ``bench/cluster_sim/calibrations/``; a new one
replaces one of them by hand, with the results built on it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.cluster_sim.cost_model import SHAPE_TERMS, Calibration, StepShape, shape_of
from bench.out_dir import default_out
from bench.sample_adapters import read_peft_directory
from bench.serving.adapters import ensure_adapter_set, evict_from_page_cache
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.policies.linear_cost import LinearCost
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.gpu_worker.service import resolve_dtype
from services.model_files.base_model import load_base_model_spec

DECODE_STEPS = 4
"""Decode steps timed after each prefill."""
RANKS = (8, 64)
REPEATS = 3
"""Times each batch shape is run (the fastest of them counts)."""


def cpu_model() -> str:
    """``model name`` from /proc/cpuinfo, with the bf16 flag when the CPU has it."""
    text = Path("/proc/cpuinfo").read_text()
    name = next(
        (line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?"
    )
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    extra = "avx512_bf16" if "avx512_bf16" in flags else ("avx2" if "avx2" in flags else "")
    cores = torch.get_num_threads()
    return f"{name} ({extra}, {cores} threads)"


def time_batch(
    engine: Engine, tag: str, requests: int, prompt: int, adapters: list[str], ranks: dict[str, int]
) -> list[tuple[StepShape, float]]:
    """Prefill ``requests`` prompts of ``prompt`` tokens (adapters round-robin), then decode."""
    params = SamplingParams(max_tokens=DECODE_STEPS + 2, ignore_eos=True)
    chosen = [adapters[i % len(adapters)] if adapters else "" for i in range(requests)]
    for i, adapter in enumerate(chosen):
        ids = tuple(100 + (i * 7 + j * 13) % 20000 for j in range(prompt))
        engine.submit(GenerationRequest(f"{tag}-{i}", ids, params, adapter or None), lambda event: None)
    samples = []
    began = time.perf_counter()
    engine.step()
    parts = [(prompt, 0, ranks.get(a, 0), a) for a in chosen]
    samples.append((shape_of(parts), 1000 * (time.perf_counter() - began)))
    for step in range(DECODE_STEPS):
        began = time.perf_counter()
        engine.step()
        parts = [(1, prompt + step + 1, ranks.get(a, 0), a) for a in chosen]
        samples.append((shape_of(parts), 1000 * (time.perf_counter() - began)))
    while engine.has_work():
        engine.step()
    return samples


def fastest(
    engine: Engine, tag: str, requests: int, prompt: int, adapters: list[str], ranks: dict[str, int]
) -> list[tuple[StepShape, float]]:
    """:func:`time_batch` ``REPEATS`` times, each step's fastest time: other jobs on a shared
    machine only ever add time, so the minimum is the closest to the engine's own cost."""
    runs = [time_batch(engine, f"{tag}-{k}", requests, prompt, adapters, ranks) for k in range(REPEATS)]
    return [(shape, min(run[i][1] for run in runs)) for i, (shape, _) in enumerate(runs[0])]


def fit(samples: list[tuple[StepShape, float]]) -> tuple[LinearCost, float]:
    """Non-negative least squares over the samples; and the mean |error| %."""
    rows = [shape.row() for shape, _ in samples]
    model = LinearCost.named(SHAPE_TERMS).fit(rows, [ms for _, ms in samples], nonnegative=True)
    errors = [abs(model.predict(row) - ms) / ms for row, (_, ms) in zip(rows, samples, strict=True)]
    return model, 100.0 * float(np.mean(errors))


def adapter_load_ms(engine: Engine, root: Path, repeats: int) -> float:
    """Median ms to read + parse + page in one adapter (page cache dropped before each read)."""
    spec = load_base_model_spec()
    adapters = ensure_adapter_set(root, spec, repeats, RANKS)
    times = []
    for index in range(adapters.count):
        evict_from_page_cache(adapters)
        adapter_id = f"load-{index}"
        began = time.perf_counter()
        host = read_peft_directory(adapter_id, adapters.directory(index), engine.executor.model.dtype)
        engine.add_adapter(host)
        engine.submit(GenerationRequest(adapter_id, (1, 2, 3), SamplingParams(max_tokens=1), adapter_id),
                      lambda event: None)  # fmt: skip
        engine.step()  # pages the adapter in and prefills 3 tokens (a few ms of it is the step)
        times.append(1000 * (time.perf_counter() - began))
        while engine.has_work():
            engine.step()
    return statistics.median(times)


def calibrate(adapter_root: Path, quick: bool) -> Calibration:
    loaded = load_model(None)
    dtype = resolve_dtype("auto", torch.device("cpu"))
    model = LlamaModel(loaded.config, loaded.weights, dtype)
    engine = local_engine(model, EngineConfig(pool_mib=512, max_running=64, max_prefill_tokens=4096))
    spec = load_base_model_spec()
    disk = ensure_adapter_set(adapter_root, spec, 32, RANKS)
    ranks: dict[str, int] = {}
    for index in range(disk.count):
        host = read_peft_directory(f"a{index}", disk.directory(index), dtype)
        engine.add_adapter(host)
        ranks[host.adapter_id] = host.max_rank
    by_rank = {r: [a for a, ar in ranks.items() if ar == r] for r in RANKS}
    time_batch(engine, "warmup", 4, 32, by_rank[8][:2], ranks)
    samples: list[tuple[StepShape, float]] = []
    sizes = (1, 6, 16) if quick else (1, 4, 16, 32)
    for requests in sizes:
        for prompt in (16, 48) if quick else (16, 64):
            for rank in RANKS:
                for distinct in sorted({1, requests}):
                    adapters = by_rank[rank][:distinct]
                    tag = f"n{requests}-p{prompt}-r{rank}-a{distinct}"
                    samples += fastest(engine, tag, requests, prompt, adapters, ranks)
                    print(tag, f"{samples[-1][1]:.1f} ms per decode step", flush=True)
            samples += fastest(engine, f"n{requests}-p{prompt}-base", requests, prompt, [], ranks)
    cost, error = fit(samples)
    load_ms = adapter_load_ms(engine, adapter_root / "load", 6 if quick else 12)
    return Calibration(cost, load_ms, cpu_model(), len(samples), error)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(default_out("cluster_sim") / "calibration.json"))
    parser.add_argument("--adapters", default="", help="adapter directory (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: a second OpenMP thread on a shared 2-core machine spins "
        "against other jobs and makes steps several times slower and erratic)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        calibration = calibrate(Path(args.adapters or tmp), args.quick)
    calibration.save(args.out)
    print(calibration)


if __name__ == "__main__":
    main()
