"""Why the PEFT baseline of ``loramesh bench`` collapsed: its decode step measured side by side in
three processes, one fresh, one that first served a trace with the loramesh engine (as the
bench's single process did before its PEFT runs), and one fresh whose OpenMP threads wait
passively (``OMP_WAIT_POLICY=PASSIVE``: they sleep at once instead of spinning), each at 2 torch
threads and at 1.

    PYTHONPATH=. .venv/bin/python -m bench.peft_collapse_probe            # 3 rounds
    PYTHONPATH=. .venv/bin/python -m bench.peft_collapse_probe --rounds 1 --tokens 4

Every process builds the baseline's own ``_PeftServer`` (the bench's adapters, ranks 8 and 16)
and warm it up. The parent then drives them in lockstep: in every round each process, in
rotating order, runs one greedy ``generate`` of ``--batch`` prompts for ``--tokens`` tokens
at each thread count, while the others wait on their pipes; so the machine's load hits every
condition alike. Per unit: the median decode step (wall), the process's CPU seconds per step,
the share of the CPUs other processes used meanwhile, and the torch thread settings in force.
Results: a table on stdout and ``bench/out/peft_collapse_probe/results.json``. Nothing is
asserted; on a shared machine read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

from bench.out_dir import default_out

CONDITIONS = ("fresh", "after-engine", "passive-wait")
PASSIVE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
"""The passive-wait process's environment on top of this one's (read when libgomp starts)."""
THREADS = (2, 1)
PROMPT_TOKENS = 32


def _worker(condition: str, batch: int, tokens: int, adapter_cache: str, conn) -> None:
    """One process of the probe: set up, then answer each ``threads`` sent with one unit."""
    import torch

    from bench.serving.adapters import ensure_adapter_set
    from bench.systems.peft_baseline import _PeftServer
    from bench.worker_bench import CpuMonitor
    from services.model_files.base_model import load_base_model_spec

    spec = load_base_model_spec(None)
    adapters = ensure_adapter_set(Path(adapter_cache), spec, 100, (8, 16))
    if condition == "after-engine":
        _serve_with_engine(adapters)
    server = _PeftServer(None, adapters, [0, 1])
    prompts = [tuple(100 + (i * 7 + j * 13) % 20000 for j in range(PROMPT_TOKENS)) for i in range(batch)]
    server.activate(0)
    server.generate(prompts, 2, lambda step: False)  # warm-up: oneDNN primitives, first-call paths
    conn.send("ready")
    monitor = CpuMonitor()
    while (threads := conn.recv()) is not None:
        torch.set_num_threads(threads)
        monitor.tick()
        cpu = time.process_time()
        steps = _step_times(server, prompts, tokens)
        cpu = time.process_time() - cpu
        conn.send(
            {
                "condition": condition,
                "threads_set": threads,
                "torch_threads": torch.get_num_threads(),
                "interop_threads": torch.get_num_interop_threads(),
                "os_threads": len(os.listdir("/proc/self/task")),
                "decode_step_s": statistics.median(steps[1:]),
                "cpu_s_per_step": cpu / len(steps),
                "others_cpu_share": round(monitor.tick(), 3),
                "load_1min": os.getloadavg()[0],
            }
        )


def _step_times(server, prompts: list[tuple[int, ...]], tokens: int) -> list[float]:
    """Seconds of each step (prefill first) of one greedy ``generate``."""
    steps: list[float] = []
    last = time.perf_counter()

    def on_step(step: int) -> bool:
        nonlocal last
        now = time.perf_counter()
        steps.append(now - last)
        last = now
        return False

    server.generate(prompts, tokens, on_step)
    return steps


def _serve_with_engine(adapters) -> None:
    """What ran before the PEFT runs in the bench's one process: the engine system on a trace."""
    from bench.systems.base import RunContext
    from bench.systems.engine_system import EngineSystem
    from bench.workload import WorkloadSpec, generate

    trace = generate(
        WorkloadSpec(
            adapters=100, rate=4, input_range=(8, 64), output_range=(8, 64), ranks=(8, 16), duration_s=5
        )
    )
    EngineSystem().run(RunContext(trace, adapters, window_s=8, pool_mib=256, host_cache_mib=48))


@contextlib.contextmanager
def _environment(overrides: dict[str, str]):
    """``os.environ`` with ``overrides`` while a child process starts (spawn copies it)."""
    saved = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=8, help="decode steps per unit")
    parser.add_argument(
        "--adapter-cache", default=str(Path.home() / ".cache" / "loramesh" / "bench-adapters")
    )
    parser.add_argument("--out", type=Path, default=default_out("peft_collapse_probe") / "results.json")
    args = parser.parse_args(argv)
    context = multiprocessing.get_context("spawn")
    pipes, processes = {}, []
    started = time.time()
    for condition in CONDITIONS:
        parent, child = context.Pipe()
        process = context.Process(
            target=_worker, args=(condition, args.batch, args.tokens, args.adapter_cache, child)
        )
        with _environment(PASSIVE_ENV if condition == "passive-wait" else {}):
            process.start()
        pipes[condition], processes = parent, [*processes, process]
    for condition in CONDITIONS:  # set-up overlaps; the units below never do
        assert pipes[condition].recv() == "ready"
    units = []
    for round_index in range(args.rounds):
        shift = round_index % len(CONDITIONS)
        order = CONDITIONS[shift:] + CONDITIONS[:shift]
        for condition in order:
            for threads in THREADS:
                pipes[condition].send(threads)
                unit = pipes[condition].recv()
                units.append({"round": round_index, **unit})
                print(json.dumps(units[-1]), flush=True)
    for condition in CONDITIONS:
        pipes[condition].send(None)
    for process in processes:
        process.join()
    summary = {
        f"{c} threads={t}": statistics.median(
            u["decode_step_s"] for u in units if u["condition"] == c and u["threads_set"] == t
        )
        for c in CONDITIONS
        for t in THREADS
    }
    result = {
        "command": " ".join(
            ["python -m bench.peft_collapse_probe", *(argv if argv is not None else sys.argv[1:])]
        ),
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
        "seconds": round(time.time() - started, 1),
        "batch": args.batch,
        "tokens": args.tokens,
        "load_1min_end": os.getloadavg()[0],
        "median_decode_step_s": summary,
        "units": units,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for key, seconds in summary.items():
        print(f"{key}: decode step {seconds * 1000:.1f} ms ({args.batch / seconds:.1f} tok/s)")


if __name__ == "__main__":
    main()
