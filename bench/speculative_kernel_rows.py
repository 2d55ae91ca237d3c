"""What a verifying row costs in the Q4_1 kernel alone: the whole model's base matmuls (every
layer's qkv, o, gate_up, down, then the output head, in a forward pass's order) at 1..N rows of
x, with nothing else of the step around them.

One pass = every prepared ``quant_linear`` call of a step, run back to back over the model's own
weights (real bytes, streamed from memory as a step streams them). Each row count's pass is
repeated ``--reps`` times, the row counts in turn; the minimum is reported (a loaded machine only
adds time), and ÷ the 1-row pass. ``--baseline-source`` times another version of
``cpu_quant_matmul.c`` in the same process, alternating with this one, and checks both give the
same bits.

    .venv/bin/python -m bench.speculative_kernel_rows --dtype float32 --reps 40
    .venv/bin/python -m bench.speculative_kernel_rows --baseline-source /tmp/old.c
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.speculative_bench import sql_rewrite
from services.gpu_worker.kernels import cpu_quant
from services.gpu_worker.model.quantized_weight import QuantizedWeight


def model_weights(model) -> list[QuantizedWeight]:
    """Every quantized matrix a step multiplies by, in the forward pass's order."""
    weights = [getattr(layer, name) for layer in model.layers for name in ("qkv", "o", "gate_up", "down")]
    weights.append(model.lm_head)
    return [w for w in weights if isinstance(w, QuantizedWeight)]


def prepared_pass(weights, rows: int, dtype, build: cpu_quant.QuantKernels, seed: int = 0):
    """The pass's prepared calls for ``rows`` rows of x (fixed random values), and its outputs."""
    generator = torch.Generator().manual_seed(seed)
    calls, outs = [], []
    for weight in weights:
        x = torch.randn(rows, weight.in_features, generator=generator).to(dtype)
        out = torch.empty(rows, weight.shape[0], dtype=dtype)
        with cpu_quant.using(build):
            calls.append(
                cpu_quant.prepare_linear(x, weight.blocks, weight.format, weight.shape[0], None, out)
            )
        outs.append((x, out))
    return calls, outs


def timed(calls) -> float:
    started = time.perf_counter()
    for call in calls:
        call.run()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=6, help="1..rows")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--baseline-source", type=Path, default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    _, model, _ = sql_rewrite("q4_1", args.dtype)
    weights = model_weights(model)
    builds = {"this": cpu_quant.kernels()}
    if args.baseline_source is not None:
        builds["baseline"] = cpu_quant.QuantKernels(source=args.baseline_source)
    passes = {
        (name, rows): prepared_pass(weights, rows, dtype, build)
        for name, build in builds.items()
        for rows in range(1, args.rows + 1)
    }
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.reps):
        for key, (calls, _) in passes.items():
            seconds = timed(calls)
            best[key] = min(best.get(key, seconds), seconds)
    if "baseline" in builds:
        for rows in range(1, args.rows + 1):
            same = all(
                torch.equal(a[1], b[1])
                for a, b in zip(passes[("this", rows)][1], passes[("baseline", rows)][1])
            )
            print(f"  {rows} rows: same bits as the baseline: {same}")
    print(f"q4_1 {args.dtype}: the model's base matmuls, ms (minimum of {args.reps}) and ÷ 1 row")
    for name in builds:
        one = best[(name, 1)]
        cells = "  ".join(
            f"{rows}: {1000 * best[(name, rows)]:.2f} ({best[(name, rows)] / one:.2f})"
            for rows in range(1, args.rows + 1)
        )
        print(f"  {name:8} {cells}")


if __name__ == "__main__":
    main()
