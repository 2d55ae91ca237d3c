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

Then the same step with every layer reading layer 0's rows (``--no-cached`` skips it): the same
calls, groups and arithmetic, but one layer's adapters (5-20 MB) stay in L2/L3, so the step costs
the kernel's arithmetic and its calls with almost no memory traffic. The two are taken in
alternation in one run; their difference is what streaming the adapters from memory adds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from services.gpu_worker.kernels.cpu_native import NativeCall, native_available, native_error
from services.gpu_worker.kernels.lora_segments import AdapterRows, LoraSegments
from services.model_files.base_model import load_base_model_spec
from services.model_files.peft_format import LORA_TARGETS

CALLS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
"""The projections the model serves in one call each: those that read the same input."""
RANKS = (8, 16, 32, 64)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def decode_step(
    k: int, tokens_per_adapter: int, dtype: torch.dtype, distinct_layers: bool = True
) -> tuple[torch.Tensor, list, int]:
    """The pool, the calls of one decode step ``(x, [(segments, out), ...])`` and the multiply-adds,
    at the default base model's shapes. Without ``distinct_layers`` every layer reads the rows of
    layer 0 (a pool of one layer)."""
    spec = load_base_model_spec()
    projections = {module: spec.projection_shape(module) for module in LORA_TARGETS}
    ranks = [RANKS[i % len(RANKS)] for i in range(k)]
    per_layer = sum(r * (i + o) for r in ranks for i, o in projections.values())
    total = spec.num_layers * per_layer
    pool = (torch.randn(total if distinct_layers else per_layer) * 0.02).to(dtype)
    batch = k * tokens_per_adapter
    order = [t % k for t in range(batch)]  # requests spread round-robin over the adapters
    inputs = {in_f: torch.randn(batch, in_f) for in_f, _ in projections.values()}
    outs = {name: torch.zeros(batch, o) for name, (_, o) in projections.items()}
    offset, calls = 0, []
    for _ in range(spec.num_layers):
        if not distinct_layers:
            offset = 0
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
    parser.add_argument("--no-cached", action="store_true", help="skip the step with the adapters in cache")
    args = parser.parse_args(argv)
    if not native_available():
        raise SystemExit(f"the native kernel is unavailable: {native_error()}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    evict = torch.ones(16 * 2**20)
    variants = ("from memory",) if args.no_cached else ("from memory", "in cache")
    for k in args.k:
        tokens_per_adapter = max(1, args.batch // k)
        steps = {}
        for variant in variants:
            pool, calls, multiply_adds = decode_step(k, tokens_per_adapter, dtype, variant == "from memory")
            # Prepared once, as the engine's StepLora does for every step of an unchanged batch.
            prepared = [
                (NativeCall(tuple(seg for seg, _ in problems)), x, [out for _, out in problems])
                for x, problems in calls
            ]
            steps[variant] = (pool, prepared, [])
        for _ in range(args.repeats + 1):  # the variants alternate, so host drift hits both alike
            for pool, prepared, seconds in steps.values():
                evict.add_(1.0)
                start = time.perf_counter()
                for call, x, outs in prepared:
                    call.run(x, outs, pool)
                seconds.append(time.perf_counter() - start)
        medians = {variant: statistics.median(seconds[1:]) for variant, (_, _, seconds) in steps.items()}
        nbytes = steps["from memory"][0].numel() * steps["from memory"][0].element_size()
        for variant, step in medians.items():
            print(
                f"k={k} ({tokens_per_adapter} tokens each, {args.dtype}, {args.threads} threads), "
                f"adapters {variant}: {1e3 * step:.2f} ms per step, {len(calls)} calls, "
                f"{nbytes / 1e6:.1f} MB ({nbytes / step / 1e9:.1f} GB/s), "
                f"{2 * multiply_adds / step / 1e9:.1f} GFLOP/s"
            )
        if len(medians) == 2:
            print(
                f"k={k}: streaming the adapters adds {1e3 * (medians['from memory'] - medians['in cache']):.2f} ms"
            )


if __name__ == "__main__":
    main()
