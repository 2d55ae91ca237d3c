"""Decode step time of each base-weight format (issue 27), side by side in one process.

    .venv/bin/python -m bench.quantized_bench            # ~3 min on 2 cores
    .venv/bin/python -m bench.quantized_bench --quick
    .venv/bin/python -m bench.quantized_bench --formats q4_1 --batches 1 --baseline-source OLD.c
    .venv/bin/python -m bench.quantized_bench --formats q4_1 --batches '' --llama-server PATH/llama-server

For each format (``none`` = dequantized fp32, ``q8_0``, ``q4_1``) and batch size (1, 8, 32) two
engines are prefilled: one whose requests use no adapter, one whose requests all use one rank-16
adapter on all seven projections (unmerged). Then every engine takes one decode step per round,
in an order that rotates between rounds, and the medians over rounds are reported: tokens/s,
the adapter's step ÷ the base step (issue 27's goal: base/adapter ≥ 0.9), and the weight bytes
one step reads ÷ its time against the read bandwidth measured at the start (a roofline for
batch 1, where decode reads every weight once per token). No timing is asserted anywhere.

``--baseline-source`` compares two versions of the quantized kernels on the same engines: every
engine steps once with each build per round (the builds' order alternating), so both see the
same contexts and the same machine; each row is reported for both.

``--llama-server`` also compares single-request decode with llama.cpp on the same GGUF (the one
the engines load): llama-server ``-t <threads> -np 1`` decodes one 128-token request at a time
(``ignore_eos``, greedy, no prompt cache; its own ``timings.predicted_per_second``), alternating
round by round with an engine decoding one request of the same prompt for 127 steps, in each
format asked for (and with each kernel build): one row per round, so drift shows. It runs
before the table, while no engine has paged in an adapter: the page-in thread's first copy
starts a second OpenMP team, and with more OpenMP threads than CPUs libgomp stops spinning at
barriers (its throttled wait): batch-1 decode of the process then drops from ~120 to ~67 tok/s
on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.out_dir import default_out
from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.kernels import cpu_quant
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.gpu_worker.model.quantized_weight import QuantizedWeight
from services.model_files.base_model import default_model_path, load_base_model_spec
from services.model_files.peft_format import LORA_TARGETS

FORMATS = ("none", "q8_0", "q4_1")
PROMPT_LEN = 32
SINGLE_TOKENS = 128
"""Tokens one request of the llama-server comparison generates."""


@dataclass(frozen=True)
class FormatRow:
    """One (format, batch) measurement."""

    format: str
    batch: int
    kernels: str
    """``head`` (this checkout's kernels) or ``baseline`` (``--baseline-source``)."""
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


def weight_bytes(weights: dict[str, torch.Tensor | QuantizedWeight]) -> int:
    """Bytes of all weights as stored (what a step that uses every weight reads)."""
    return sum(
        w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size() for w in weights.values()
    )


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
    engine = local_engine(model, EngineConfig(pool_mib=256, max_running=max(batch, 1)))
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


def measure(
    formats: tuple[str, ...],
    batches: tuple[int, ...],
    rounds: int,
    adapter_dir: Path,
    dtype: torch.dtype,
    baseline: cpu_quant.QuantKernels | None = None,
) -> list[FormatRow]:
    builds = {"head": None} if baseline is None else {"head": None, "baseline": baseline}
    labels = list(builds)
    models = {}
    for fmt in formats:
        loaded = load_model(quantization=fmt, dtype=dtype)
        models[fmt] = (LlamaModel(loaded.config, loaded.weights, dtype), weight_bytes(loaded.weights))
    keys = [
        (fmt, batch, with_adapter) for fmt in formats for batch in batches for with_adapter in (False, True)
    ]
    engines = {
        key: prefilled_engine(
            models[key[0]][0], key[1], adapter_dir if key[2] else None, len(labels) * rounds + 8
        )
        for key in keys
    }
    times: dict[tuple, list[float]] = {(label, key): [] for label in labels for key in keys}
    for round_index in range(rounds if keys else 0):
        shift = round_index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            order = labels if round_index % 2 == 0 else labels[::-1]
            for label in order:
                build = builds[label]
                with nullcontext() if build is None else cpu_quant.using(build):
                    start = time.perf_counter()
                    engines[key].step()
                    times[(label, key)].append(time.perf_counter() - start)
    return [
        FormatRow(
            fmt,
            batch,
            label,
            statistics.median(times[(label, (fmt, batch, False))]) * 1e3,
            statistics.median(times[(label, (fmt, batch, True))]) * 1e3,
            models[fmt][1] / 2**20,
        )
        for fmt in formats
        for batch in batches
        for label in labels
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


class LlamaServer:
    """llama-server on ``gguf`` with one slot, started and stopped with the comparison."""

    def __init__(self, binary: Path, gguf: Path, threads: int):
        self.url = f"http://127.0.0.1:{_free_port()}"
        port = self.url.rsplit(":", 1)[1]
        self._process = subprocess.Popen(
            [str(binary), "-m", str(gguf), "-t", str(threads), "-np", "1", "-c", "512", "--port", port,
             "--no-webui"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"llama-server did not come up at {self.url}")
            time.sleep(0.5)

    def tokens_per_s(self, prompt: list[int]) -> float:
        """One greedy request of SINGLE_TOKENS tokens: llama-server's own decode rate."""
        reply = _post(
            self.url + "/completion",
            {"prompt": prompt, "n_predict": SINGLE_TOKENS, "ignore_eos": True, "temperature": 0.0,
             "cache_prompt": False},
        )  # fmt: skip
        return float(reply["timings"]["predicted_per_second"])

    def close(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def engine_tokens_per_s(model: LlamaModel, build: cpu_quant.QuantKernels | None) -> float:
    """One request decoding SINGLE_TOKENS - 1 steps after its prefill (the first token), alone."""
    with nullcontext() if build is None else cpu_quant.using(build):
        engine = prefilled_engine(model, 1, None, SINGLE_TOKENS)
        start = time.perf_counter()
        for _ in range(SINGLE_TOKENS - 1):
            engine.step()
        return (SINGLE_TOKENS - 1) / (time.perf_counter() - start)


def versus_llama_server(
    binary: Path, formats: tuple[str, ...], dtype: torch.dtype, baseline: cpu_quant.QuantKernels | None,
    rounds: int,
) -> tuple[list[str], list[list[float]]]:  # fmt: skip
    """Columns and, per round, tokens/s: llama-server's 3 requests, then each engine's one."""
    builds = {"head": None} if baseline is None else {"head": None, "baseline": baseline}
    models = {}
    for fmt in formats:
        loaded = load_model(quantization=fmt, dtype=dtype)
        models[fmt] = LlamaModel(loaded.config, loaded.weights, dtype)
    engines = [(f"{fmt} {label}", models[fmt], build) for fmt in formats for label, build in builds.items()]
    prompt = [1000 + j for j in range(PROMPT_LEN)]
    server = LlamaServer(binary, default_model_path(), torch.get_num_threads())
    try:
        server.tokens_per_s(prompt)  # warm-up, like each engine's first prefill below
        for _, model, build in engines:
            engine_tokens_per_s(model, build)
        results = []
        for round_index in range(rounds):
            order = engines if round_index % 2 == 0 else engines[::-1]
            by_name = {name: engine_tokens_per_s(model, build) for name, model, build in order}
            llama = [server.tokens_per_s(prompt) for _ in range(3)]
            results.append([*llama, *(by_name[name] for name, _, _ in engines)])
    finally:
        server.close()
    return ["llama-server", "llama-server", "llama-server", *(name for name, _, _ in engines)], results


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def table(rows: list[FormatRow], bandwidth: float) -> str:
    lines = [
        "| format | batch | kernels | weights MiB | base tok/s | 1 adapter tok/s | adapter ÷ base | batch-1 bytes/step ÷ bandwidth |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        achieved = row.weight_mib / 1024 / (row.base_step_ms / 1e3)
        roofline = f"{achieved:.1f} GiB/s = {achieved / bandwidth:.2f}" if row.batch == 1 else ""
        lines.append(
            f"| {row.format} | {row.batch} | {row.kernels} | {row.weight_mib:.0f} | {row.base_tokens_per_s:.1f} | "
            f"{row.adapter_tokens_per_s:.1f} | {row.adapter_over_base:.2f} | {roofline} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds instead of 20")
    parser.add_argument("--batches", default="1,8,32", help="of the table ('' for none)")
    parser.add_argument("--formats", default=",".join(FORMATS), help="of " + ", ".join(FORMATS))
    parser.add_argument("--baseline-source", type=Path, default=None,
                        help="another cpu_quant_matmul.c to time beside this checkout's, step by step")  # fmt: skip
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="storage dtype of everything not quantized (KV, adapters, norms)")  # fmt: skip
    parser.add_argument("--llama-server", type=Path, default=None,
                        help="also compare single-request decode with this llama-server binary")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(",") if b)
    formats = tuple(args.formats.split(","))
    if unknown := set(formats) - set(FORMATS):
        parser.error(f"unknown formats {sorted(unknown)}")
    baseline = None
    if args.baseline_source is not None:
        baseline = cpu_quant.QuantKernels(source=args.baseline_source.resolve())
        if not baseline.available:
            parser.error(f"the baseline kernels did not build: {baseline.error}")
    rounds = 5 if args.quick else 20
    dtype = getattr(torch, args.dtype)
    single = None
    if args.llama_server is not None:
        columns, per_round = versus_llama_server(
            args.llama_server, formats, dtype, baseline, 3 if args.quick else 5
        )
        single = {"columns": columns, "tokens_per_s": per_round}
    bandwidth = read_bandwidth_gib_s()
    with tempfile.TemporaryDirectory() as tmp:
        adapter_dir = write_peft_adapter(
            Path(tmp) / "r16", load_base_model_spec(), SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS)
        )
        rows = measure(formats, batches, rounds, adapter_dir, dtype, baseline)
    header = (
        f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.backends.cpu.get_cpu_capability()}, "
        f"quantized kernels: {cpu_quant.kernels().isa}; read bandwidth {bandwidth:.1f} GiB/s; {args.dtype}"
        + (f"; baseline kernels: {args.baseline_source}" if baseline is not None else "")
    )
    print(header)
    print(table(rows, bandwidth))
    if single is not None:
        print(f"\nOne request, {SINGLE_TOKENS} tokens, tok/s per round (engines in {args.dtype}):")
        print("| round | " + " | ".join(single["columns"]) + " |")
        print("|---|" + "---|" * len(single["columns"]))
        for round_index, values in enumerate(single["tokens_per_s"], 1):
            print(f"| {round_index} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
    out = args.out or default_out(f"quantized_bench_{args.dtype}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps(
            {
                "header": header,
                "bandwidth_gib_s": bandwidth,
                "rows": [asdict(r) for r in rows],
                "versus_llama_server": single,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
