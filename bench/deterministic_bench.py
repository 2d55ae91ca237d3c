"""What deterministic serving costs: engine prefill and decode throughput with batch-invariant
numerics (``EngineConfig.deterministic``) against the default path, side by side in one run.

    flock /tmp/loramesh-cpu.lock env PYTHONPATH=. .venv/bin/python bench/deterministic_bench.py
    PYTHONPATH=. .venv/bin/python bench/deterministic_bench.py --quick     # 1 round, short

For fp32 and bf16 storage and batches of 1, 8 and 32 requests on SmolLM2-135M-Instruct (each
request on one of 4 PEFT adapters, ranks 8/16/32/64 on all seven projections, round robin): two
engines share one model, one default, one deterministic. Each round both get the same fresh
batch (distinct prompts of ``--prompt-len`` tokens), prefill it in one step, then decode
``--decode-steps`` steps; the two engines' steps alternate, the order swapping every round, so
the host's drift (this VM's steps move between a fast and a slow regime) hits both alike.
Prefill throughput is the batch's prompt tokens over the prefill step's time, decode throughput
the batch over a decode step's time, each the median over rounds (decode: over every step of
every round); the cost is deterministic ÷ default. Steps during which other processes used more
than 10% of the CPUs are left out of the medians when enough quiet ones remain (the report
says how many). The machine (CPU model, flags, torch, threads) is recorded with the figures.
Results: a markdown table on stdout and ``bench/out/deterministic_bench/results.json``. No
timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.out_dir import default_out
from bench.worker_bench import CpuMonitor, machine, make_adapters, make_prompts
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.compute_dtype import cpu_has_half_gemm
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model

MODES = ("default", "deterministic")
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")
"""The /proc/cpuinfo flags the kernels (and oneDNN's choices) depend on, recorded with the figures."""
DTYPES = ("float32", "bfloat16")
QUIET = 0.10
"""A step is quiet when other processes used at most this share of the CPUs during it."""


def cpu_flags() -> list[str]:
    """Which of :data:`CPU_FLAGS` this CPU has."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return [flag for flag in CPU_FLAGS if flag in flags]


def quiet_median(samples: list[tuple[float, float]]) -> tuple[float, int]:
    """Median seconds of the quiet (seconds, others' share) samples when at least half are quiet,
    else of all; and how many samples it took."""
    quiet = [s for s, others in samples if others <= QUIET]
    chosen = quiet if len(quiet) * 2 >= len(samples) else [s for s, _ in samples]
    return statistics.median(chosen), len(chosen)


def run_batch(
    engines: dict[str, Engine],
    prompts: list[tuple[int, ...]],
    adapter_ids: list[str],
    decode_steps: int,
    rounds: int,
    monitor: CpuMonitor,
) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Per mode, the (seconds, others' CPU share) of every prefill step and decode step."""
    times: dict[str, dict[str, list]] = {mode: {"prefill": [], "decode": []} for mode in engines}
    sampling = SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True)
    for round_index in range(rounds):
        order = list(engines) if round_index % 2 == 0 else list(engines)[::-1]
        for mode in order:
            for i, (prompt, adapter) in enumerate(zip(prompts, adapter_ids)):
                engines[mode].submit(
                    GenerationRequest(f"{mode}-{round_index}-{i}", prompt, sampling, adapter),
                    lambda event: None,
                )
        for step in range(decode_steps + 1):
            for mode in order:
                monitor.tick()
                started = time.perf_counter()
                engines[mode].step()
                seconds = time.perf_counter() - started
                times[mode]["prefill" if step == 0 else "decode"].append((seconds, monitor.tick()))
        for mode in order:
            while engines[mode].has_work():
                engines[mode].step()
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 4 decode steps, prompts of 32")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 64; quick 32")
    parser.add_argument("--decode-steps", type=int, default=None, help="per round (default 12; quick 4)")
    parser.add_argument("--rounds", type=int, default=None, help="default 3; quick 1")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=default_out("deterministic_bench") / "results.json")
    args = parser.parse_args(argv)
    prompt_len = args.prompt_len or (32 if args.quick else 64)
    decode_steps = args.decode_steps or (4 if args.quick else 12)
    rounds = args.rounds or (1 if args.quick else 3)
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result: dict = {
        "command": " ".join(["bench/deterministic_bench.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {
            **machine(),
            "cpu_flags": cpu_flags(),
            "onednn_native_bf16": cpu_has_half_gemm(torch.bfloat16),
        },
        "prompt_len": prompt_len,
        "decode_steps": decode_steps,
        "rounds": rounds,
        "rows": [],
    }
    print(f"machine: {result['machine']}", flush=True)
    loaded = load_model()
    monitor = CpuMonitor()
    adapters_root = Path(tempfile.mkdtemp(prefix="det-bench-"))
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        model = LlamaModel(loaded.config, loaded.weights, dtype)
        adapters = make_adapters(4, dtype, adapters_root / dtype_name)
        for batch in batches:
            engines = {
                mode: local_engine(
                    model,
                    EngineConfig(pool_mib=512, max_running=batch, deterministic=mode == "deterministic"),
                )
                for mode in MODES
            }
            for engine in engines.values():
                for adapter in adapters:
                    engine.add_adapter(adapter)
            prompts = make_prompts(loaded, batch, prompt_len)
            adapter_ids = [adapters[i % len(adapters)].adapter_id for i in range(batch)]
            # A warm-up batch first: kernels compiled, adapters paged in, caches grown.
            run_batch(engines, prompts, adapter_ids, 2, 1, monitor)
            times = run_batch(engines, prompts, adapter_ids, decode_steps, rounds, monitor)
            row: dict = {"dtype": dtype_name, "compute_dtype": str(model.compute_dtype), "batch": batch}
            for mode in MODES:
                prefill_s, prefill_n = quiet_median(times[mode]["prefill"])
                decode_s, decode_n = quiet_median(times[mode]["decode"])
                row[mode] = {
                    "prefill_tok_s": round(batch * prompt_len / prefill_s, 1),
                    "decode_tok_s": round(batch / decode_s, 1),
                    "prefill_steps": prefill_n,
                    "decode_steps": decode_n,
                }
            for phase in ("prefill_tok_s", "decode_tok_s"):
                row[f"{phase.split('_')[0]}_ratio"] = round(
                    row["deterministic"][phase] / row["default"][phase], 3
                )
            result["rows"].append(row)
            print(
                f"[{time.perf_counter() - started:5.0f} s] {dtype_name} batch {batch}: "
                f"prefill ×{row['prefill_ratio']}, decode ×{row['decode_ratio']}",
                flush=True,
            )
    ratios = [row[key] for row in result["rows"] for key in ("prefill_ratio", "decode_ratio")]
    result["geomean_ratio"] = round(statistics.geometric_mean(ratios), 3)
    result["worst_ratio"] = min(ratios)
    result["others_cpu_share"] = round(monitor.total(), 3)
    result["seconds"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(report(result))


def report(result: dict) -> str:
    m = result["machine"]
    machine_line = (
        f"CPU: {m.get('cpu')} ({m.get('logical_cpus')} logical CPUs; flags {' '.join(m.get('cpu_flags', []))}; "
        f"oneDNN native bf16: {m.get('onednn_native_bf16')}; torch {m.get('torch')} "
        f"capability {m.get('torch_cpu_capability')}, {m.get('torch_threads')} threads)"
    )
    run_line = (
        f"prompts of {result['prompt_len']} tokens, {result['decode_steps']} decode steps, "
        f"{result['rounds']} rounds; others used {result['others_cpu_share']:.0%} of the CPUs"
    )
    header = (
        "| storage (compute) | batch | prefill tok/s default | deterministic | ratio "
        "| decode tok/s default | deterministic | ratio |"
    )
    lines = [machine_line, run_line, "", header, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        d, v = row["default"], row["deterministic"]
        lines.append(
            f"| {row['dtype']} ({row['compute_dtype'].removeprefix('torch.')}) | {row['batch']} "
            f"| {d['prefill_tok_s']} | {v['prefill_tok_s']} | {row['prefill_ratio']:.2f} "
            f"| {d['decode_tok_s']} | {v['decode_tok_s']} | {row['decode_ratio']:.2f} |"
        )
    lines += ["", f"geometric mean ratio {result['geomean_ratio']:.2f}, worst {result['worst_ratio']:.2f}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
