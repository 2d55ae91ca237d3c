"""Triton LoRA kernel launches per decoder layer, one projection per call (before) against the
model's calls with the stacked kernels (after):

    PYTHONPATH=. .venv/bin/python bench/lora_launch_count.py
    PYTHONPATH=. .venv/bin/python bench/lora_launch_count.py --k 4 --batch 8 --batch-invariant

One decode layer at the default base model's shapes (SmolLM2-135M: seven projections, all
targeted), ``--k`` adapters of ranks 8/16/32/64 round-robin over ``--batch`` decode rows, as
``lora_kernel_bench.decode_step`` lays them out. Launches are counted at the kernels themselves
(each ``kernel[grid]``), so what is counted is what a GPU would be asked to run; without CUDA the
kernels run in Triton's CPU interpreter, which counts the same launches (a GPU's timings are not
measured here). Both ways' outputs are compared, and the whole model's count per decode step is
the layer's times the number of layers.
"""

from __future__ import annotations

import argparse
import os

import torch

from bench.lora_kernel_bench import CALLS, decode_step
from services.model_files.base_model import load_base_model_spec

KERNELS = {
    "triton_lora": ("_mbgmv_shrink", "_mbgmv_expand", "_mbgmm_shrink", "_mbgmm_expand"),
    "triton_stacked_lora": ("_stacked_shrink", "_stacked_expand"),
}
"""The Triton kernels of the LoRA backends, by module."""


class _Counted:
    """A Triton kernel that counts its launches (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def count_launches(run, modules: dict) -> int:
    """The Triton launches ``run()`` makes, counted by wrapping the kernels while it runs."""
    counted = []
    for module_name, names in KERNELS.items():
        module = modules[module_name]
        for name in names:
            wrapper = _Counted(getattr(module, name))
            setattr(module, name, wrapper)
            counted.append((module, name, wrapper))
    try:
        run()
    finally:
        for module, name, wrapper in counted:
            setattr(module, name, wrapper.kernel)
    return sum(wrapper.launches for _, _, wrapper in counted)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--k", type=int, default=2, help="distinct adapters")
    parser.add_argument("--batch", type=int, default=4, help="decode rows, spread over the k adapters")
    parser.add_argument("--batch-invariant", action="store_true", help="MBGMV with one program per token")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' first import, which decides
    from services.gpu_worker.kernels import triton_lora, triton_stacked_lora
    from services.gpu_worker.kernels.dispatch import StepLora

    modules = {"triton_lora": triton_lora, "triton_stacked_lora": triton_stacked_lora}
    torch.manual_seed(0)
    pool, calls, _ = decode_step(args.k, max(1, args.batch // args.k), torch.float32, False)
    pool = pool.to(device)
    layer = [(names, x.to(device), problems) for names, (x, problems) in zip(CALLS, calls)]
    segments = {n: seg for names, _, problems in layer for n, (seg, _) in zip(names, problems)}
    inputs = {n: x for names, x, _ in layer for n in names}
    results = {}
    for way, grouping in (("before", [(n,) for names in CALLS for n in names]), ("after", list(CALLS))):
        step = StepLora([segments])
        outs = {
            n: torch.zeros_like(out, device=device)
            for names, _, ps in layer
            for n, (_, out) in zip(names, ps)
        }

        def run(step=step, grouping=grouping, outs=outs):
            for names in grouping:
                outputs = tuple(outs[n] for n in names)
                step.add_deltas(0, names, inputs[names[0]], outputs, pool, "triton", args.batch_invariant)

        results[way] = (count_launches(run, modules), outs)
    before, after = results["before"][0], results["after"][0]
    difference = max((results["before"][1][n] - results["after"][1][n]).abs().max().item() for n in segments)
    layers = load_base_model_spec().num_layers
    print(
        f"{device}: k={args.k}, {args.batch} decode rows, batch_invariant={args.batch_invariant}: "
        f"Triton LoRA launches per layer {before} -> {after} ({layers} layers: {before * layers} -> "
        f"{after * layers} per decode step); largest |before - after| {difference:.2e}"
    )


if __name__ == "__main__":
    main()
