"""The native CPU LoRA kernel alone, on one decode step's worth of calls (issue 3).

    PYTHONPATH=. .venv/bin/python bench/lora_kernel_bench.py                  # k = 8 and 32, bf16
    PYTHONPATH=. .venv/bin/python bench/lora_kernel_bench.py --k 8 --batch 64 --dtype float32

The default base model's shapes (SmolLM2-135M: 30 layers of seven projections), issued as the
model issues them (one call for q/k/v, one for o, one for gate/up, one for down: 120 calls).
k adapters of ranks 8/16/32/64 round-robin share ``--batch`` decode tokens (32: 4 tokens each at
k = 8, 1 at k = 32), their rows laid out one (layer, projection) after another as the unified
pool places them. Before every timed step a 64 MiB buffer is rewritten, so the adapters
(147-586 MB in bf16) come from memory, as in a decode step where the base model's weights pass
through the caches in between. Prints the median step time, the bytes read per second and the
arithmetic rate. No engine, so this isolates the kernel and its Python call from the rest of a step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from services.gpu_worker.kernels.cpu_native import NativeCall, native_available, native_error
from services.gpu_worker.kernels.lora_segments import AdapterRows, LoraSegments
from services.runtime.base_model import LORA_TARGETS, load_base_model_spec

CALLS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
"""The projections the model serves in one call each: those that read the same input."""
RANKS = (8, 16, 32, 64)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def decode_step(k: int, tokens_per_adapter: int, dtype: torch.dtype) -> tuple[torch.Tensor, list, int]:
    """The pool, the calls of one decode step ``(x, [(segments, out), ...])`` and the multiply-adds,
    at the default base model's shapes."""
    spec = load_base_model_spec()
    projections = {module: spec.projection_shape(module) for module in LORA_TARGETS}
    ranks = [RANKS[i % len(RANKS)] for i in range(k)]
    total = spec.num_layers * sum(r * (i + o) for r in ranks for i, o in projections.values())
    pool = (torch.randn(total) * 0.02).to(dtype)
    batch = k * tokens_per_adapter
    order = [t % k for t in range(batch)]  # requests spread round-robin over the adapters
    inputs = {in_f: torch.randn(batch, in_f) for in_f, _ in projections.values()}
    outs = {name: torch.zeros(batch, o) for name, (_, o) in projections.items()}
    offset, calls = 0, []
    for _ in range(spec.num_layers):
        segments = {}
        for name, (in_f, out_f) in projections.items():
            rows = []
            for r in ranks:
                a = offset + in_f * torch.arange(r)
                offset += r * in_f
                b = offset + out_f * torch.arange(r)
                offset += r * out_f
                rows.append(AdapterRows(a, b))
            segments[name] = LoraSegments.build(
                [1] * batch, [rows[i] for i in order], [0.5] * batch, in_f, out_f, "cpu"
            )
        for names in CALLS:
            x = inputs[projections[names[0]][0]]
            calls.append((x, [(segments[n], outs[n]) for n in names]))
    return pool, calls, total * tokens_per_adapter


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--k", type=int, nargs="+", default=[8, 32], help="numbers of distinct adapters")
    parser.add_argument("--batch", type=int, default=32, help="decode tokens, spread over the k adapters")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    if not native_available():
        raise SystemExit(f"the native kernel is unavailable: {native_error()}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    evict = torch.ones(16 * 2**20)
    for k in args.k:
        pool, calls, multiply_adds = decode_step(k, max(1, args.batch // k), dtype)
        # Prepared once, as the engine's StepLora does for every step of an unchanged batch.
        prepared = [
            (NativeCall(tuple(seg for seg, _ in problems)), x, [out for _, out in problems])
            for x, problems in calls
        ]
        seconds = []
        for _ in range(args.repeats + 1):
            evict.add_(1.0)
            start = time.perf_counter()
            for call, x, outs in prepared:
                call.run(x, outs, pool)
            seconds.append(time.perf_counter() - start)
        step = statistics.median(seconds[1:])
        nbytes = pool.numel() * pool.element_size()
        print(
            f"k={k} ({args.batch // k} tokens each, {args.dtype}, {args.threads} threads): "
            f"{1e3 * step:.2f} ms per step, {len(calls)} calls, {nbytes / 1e6:.1f} MB "
            f"({nbytes / step / 1e9:.1f} GB/s), {2 * multiply_adds / step / 1e9:.1f} GFLOP/s"
        )


if __name__ == "__main__":
    main()
