"""Part 5, what the work in hand adds: its sub-parts in turn, each in its own try/except and
recorded as it finishes; and its two small ones, which ``--quantization`` settings this device
accepts and whether tensor parallelism can run here."""

from __future__ import annotations

import gc

import torch

from bench.gpu_checklist.context import Ctx
from bench.gpu_checklist.deterministic import part5_deterministic
from bench.gpu_checklist.helpers import recorded
from bench.gpu_checklist.prefix_cache import part5_prefix_cache
from bench.gpu_checklist.structured_outputs import part5_structured


def part5_quantization(ctx: Ctx) -> dict:
    """Which ``--quantization`` settings a worker on this device accepts (the quantized-weight
    kernels are CPU-only: ``quantization_setting.resolve_quantization``)."""
    from services.gpu_worker.quantization_setting import QUANTIZATION_CHOICES, resolve_quantization

    settings = {}
    for setting in QUANTIZATION_CHOICES:
        try:
            settings[setting] = {"runs": resolve_quantization(setting, ctx.device.type)}
        except ValueError as exc:
            settings[setting] = {"refused": str(exc)}
    return {"device_type": ctx.device.type, "settings": settings}


def part5_tp(ctx: Ctx) -> dict:
    gpus = torch.cuda.device_count() if ctx.cuda else 0
    return {"gpus": gpus, "run": False,
            "note": "TP=2 on NCCL needs two GPUs" if gpus < 2 else "not in this checklist: bench/tp_bench.py"}  # fmt: skip


def part5(ctx: Ctx) -> dict:
    result: dict = {}
    for name, fn in (
        ("quantization", part5_quantization),
        ("tensor_parallel", part5_tp),
        ("deterministic", part5_deterministic),
        ("structured_output", part5_structured),
        ("prefix_cache", part5_prefix_cache),
    ):
        ctx.log(f"part 5 {name} ...")
        result[name] = recorded(ctx, f"part 5 {name}", fn, ctx)
        ctx.log(f"part 5 {name}: {result[name]['seconds']:.1f} s")
        if ctx.on_partial is not None:
            ctx.on_partial("5", result)
        if ctx.cuda:
            torch.cuda.empty_cache()
        gc.collect()
    return result
