"""Decode step time of each base-weight format (issue 27), side by side in one process.

    .venv/bin/python -m bench.quantized_bench            # ~3 min on 2 cores
    .venv/bin/python -m bench.quantized_bench --quick

For each format (``none`` = dequantized fp32, ``q8_0``, ``q4_1``) and batch size (1, 8, 32) two
engines are prefilled: one whose requests use no adapter, one whose requests all use one rank-16
adapter on all seven projections (unmerged). Then every engine takes one decode step per round,
in an order that rotates between rounds, and the medians over rounds are reported: tokens/s,
the adapter's step ÷ the base step (issue 27's goal: base/adapter ≥ 0.9), and the weight bytes
one step reads ÷ its time against the read bandwidth measured at the start (a roofline for
batch 1, where decode reads every weight once per token). No timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.out_dir import default_out
from loramesh_cli.sample_adapters import SampleAdapterSpec, write_peft_adapter
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.kernels import cpu_quant
from services.gpu_worker.lora.host_adapter import read_peft_directory
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.gpu_worker.model.quantization import weight_bytes
from services.model_files.base_model import load_base_model_spec
from services.model_files.peft_format import LORA_TARGETS

FORMATS = ("none", "q8_0", "q4_1")
PROMPT_LEN = 32


@dataclass(frozen=True)
class FormatRow:
    """One (format, batch) measurement."""

    format: str
    batch: int
    base_step_ms: float
    """Median decode step, no adapter."""
    adapter_step_ms: float
    """Median decode step, every request on one rank-16 all-projection adapter."""
    weight_mib: float
    """Base weights as stored: what a decode step reads at least once."""

    @property
    def base_tokens_per_s(self) -> float:
        return self.batch / self.base_step_ms * 1e3

    @property
    def adapter_tokens_per_s(self) -> float:
        return self.batch / self.adapter_step_ms * 1e3

    @property
    def adapter_over_base(self) -> float:
        """Adapter tokens/s ÷ base tokens/s (goal ≥ 0.9)."""
        return self.base_step_ms / self.adapter_step_ms


def read_bandwidth_gib_s(mib: int = 512, repeats: int = 5) -> float:
    """Best of ``repeats`` full reads (a sum) of a ``mib`` MiB fp32 tensor, all threads."""
    data = torch.ones(mib * 2**18)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return mib / 1024 / best


def prefilled_engine(model: LlamaModel, batch: int, adapter_dir: Path | None, new_tokens: int) -> Engine:
    engine = Engine(model, EngineConfig(pool_mib=256, max_running=max(batch, 1)))
    adapter_id = None
    if adapter_dir is not None:
        engine.add_adapter(read_peft_directory("bench-r16", adapter_dir, model.dtype))
        adapter_id = "bench-r16"
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = tuple(1000 + (i * 37 + j) % 20000 for j in range(PROMPT_LEN))
        engine.submit(GenerationRequest(f"r{i}", prompt, sampling, adapter_id), lambda event: None)
    while engine.stats().running < batch or engine.stats().queue:
        engine.step()
    return engine


def measure(batches: tuple[int, ...], rounds: int, adapter_dir: Path, dtype: torch.dtype) -> list[FormatRow]:
    models = {}
    for fmt in FORMATS:
        loaded = load_model(quantization=fmt, dtype=dtype)
        models[fmt] = (LlamaModel(loaded.config, loaded.weights, dtype), weight_bytes(loaded.weights))
    keys = [
        (fmt, batch, with_adapter) for fmt in FORMATS for batch in batches for with_adapter in (False, True)
    ]
    engines = {
        key: prefilled_engine(models[key[0]][0], key[1], adapter_dir if key[2] else None, rounds + 8)
        for key in keys
    }
    times: dict[tuple, list[float]] = {key: [] for key in keys}
    for round_index in range(rounds):
        shift = round_index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            start = time.perf_counter()
            engines[key].step()
            times[key].append(time.perf_counter() - start)
    return [
        FormatRow(
            fmt,
            batch,
            statistics.median(times[(fmt, batch, False)]) * 1e3,
            statistics.median(times[(fmt, batch, True)]) * 1e3,
            models[fmt][1] / 2**20,
        )
        for fmt in FORMATS
        for batch in batches
    ]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def table(rows: list[FormatRow], bandwidth: float) -> str:
    lines = [
        "| format | batch | weights MiB | base tok/s | 1 adapter tok/s | adapter ÷ base | batch-1 bytes/step ÷ bandwidth |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        achieved = row.weight_mib / 1024 / (row.base_step_ms / 1e3)
        roofline = f"{achieved:.1f} GiB/s = {achieved / bandwidth:.2f}" if row.batch == 1 else ""
        lines.append(
            f"| {row.format} | {row.batch} | {row.weight_mib:.0f} | {row.base_tokens_per_s:.1f} | "
            f"{row.adapter_tokens_per_s:.1f} | {row.adapter_over_base:.2f} | {roofline} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds instead of 20")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="storage dtype of everything not quantized (KV, adapters, norms)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(","))
    rounds = 5 if args.quick else 20
    bandwidth = read_bandwidth_gib_s()
    with tempfile.TemporaryDirectory() as tmp:
        adapter_dir = write_peft_adapter(
            Path(tmp) / "r16", load_base_model_spec(), SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS)
        )
        dtype = getattr(torch, args.dtype)
        rows = measure(batches, rounds, adapter_dir, dtype)
    header = (
        f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.backends.cpu.get_cpu_capability()}, "
        f"quantized kernels: {cpu_quant.kernels().isa}; read bandwidth {bandwidth:.1f} GiB/s; {args.dtype}"
    )
    print(header)
    print(table(rows, bandwidth))
    out = args.out or default_out(f"quantized_bench_{args.dtype}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps(
            {"header": header, "bandwidth_gib_s": bandwidth, "rows": [asdict(r) for r in rows]}, indent=2
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
