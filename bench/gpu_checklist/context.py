"""The run's context: its settings, the lazily built things its parts share (the model, the
copy bandwidth, the Triton kernels), and how a part times a call."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu_checklist.base_model import load_base


class Ctx:
    """Run-wide settings and lazily built shared things (model, bandwidth)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.quick = args.quick
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_checklist_"))
        self._model = None
        self._copy_bw = None
        self._triton = None
        self.on_partial = None
        """``(part key, its result so far)``: records a long part's finished sub-parts (main sets it)."""

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def model(self) -> dict:
        """``{"config", "weights" (fp32, CPU), "spec", "source"}``."""
        if self._model is None:
            self._model = load_base(self.args.model, layers=4 if self.quick else None)
            self.log(f"model: {self._model['source']}")
        return self._model

    def triton(self):
        """The compiled (or, with TRITON_INTERPRET=1 on a CPU, interpreted) Triton kernels module,
        or raise RuntimeError with why not."""
        if self._triton is None:
            interpret = os.environ.get("TRITON_INTERPRET") == "1"
            if not self.cuda and not interpret:
                raise RuntimeError("skipped: Triton needs CUDA (or TRITON_INTERPRET=1 on a CPU)")
            if self.cuda and interpret:
                raise RuntimeError(
                    "skipped: TRITON_INTERPRET=1 is set on CUDA; unset it for compiled kernels"
                )
            from services.gpu_worker.kernels import triton_lora

            self._triton = triton_lora
        return self._triton

    def copy_bandwidth(self) -> dict:
        """Device-to-device copy bandwidth, bytes read + written per second."""
        if self._copy_bw is None:
            mib = 16 if self.quick else 1024
            src = torch.ones(mib * 2**20 // 4, device=self.device)
            dst = torch.empty_like(src)
            ms = bench_ms(self, lambda: dst.copy_(src), rep_ms=200)
            nbytes = 2 * src.numel() * 4
            self._copy_bw = {"tensor_mib": mib, "ms": ms, "gb_s": nbytes / (ms * 1e-3) / 1e9}
            del src, dst
            self.log(f"copy bandwidth: {self._copy_bw['gb_s']:.0f} GB/s")
        return self._copy_bw


def bench_ms(ctx: Ctx, fn, rep_ms: float = 40.0, warmup_ms: float = 10.0) -> float:
    """Median milliseconds of ``fn``: triton's do_bench on CUDA (L2 flushed before each run),
    else a perf_counter loop."""
    if ctx.cuda:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)
