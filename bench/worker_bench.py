"""gpu_worker engine speed on CPU: base decode against HF ``generate``, LoRA adapter overhead
against the memory-bandwidth bound, and the gather path against padded bmm (issue 3).

    PYTHONPATH=. .venv/bin/python bench/worker_bench.py            # full run (~10 min)
    PYTHONPATH=. .venv/bin/python bench/worker_bench.py --quick    # short run (~3 min)

Everything runs in one process, on the default base model (SmolLM2-135M-Instruct), in bf16
(``--dtype``) with ``--threads`` torch threads (2). Figures are ratios measured side by side in
this one run; no timing is asserted anywhere.

1. Base decode, batch 32, no adapters: the engine (32 requests of the same prompt length,
   ``ignore_eos``; only the decode steps are timed, the prefill step is not) against HF
   ``LlamaForCausalLM.generate`` on the same weights (decode time = ``generate(new_tokens)``
   minus ``generate(1)``, which is the prefill plus one token). Runs alternate engine / HF.
2. Adapter overhead: batch 32 decode with k = 1, 8, 32 distinct adapters (ranks 8/16/32/64
   round-robin, all seven projections, bf16), requests spread round-robin over the k adapters.
   The extra step time over the no-adapter step time is set against a bound: the bytes of the k
   adapters' weights (each read once per decode step) / the memory bandwidth measured here.
3. The same batches with ``lora_backend="torch"`` (gather by runs) and ``"padded_bmm"``
   (S-LoRA's bmm ablation baseline).

For 2 and 3 one engine per k (and one without adapters) is prefilled, then the engines are
stepped in rounds: each round steps every engine twice, the adapter engines once per backend
(the backend order alternates between rounds), so every figure compared comes from
interleaved steps at the same context length. The backend is switched between steps through
``LlamaModel.lora_backend``, the attribute ``Engine`` sets from ``EngineConfig.lora_backend``;
the engines share one ``LlamaModel``, so the attribute is set right before every step.
Finally one decode step without adapters and one with k = 32 are profiled (torch.profiler).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loramesh.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.lora.host_adapter import HostAdapter, parse_peft_adapter
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import LoadedModel, load_model
from services.runtime.base_model import LORA_TARGETS, load_base_model_spec

RANKS = (8, 16, 32, 64)
BACKENDS = ("torch", "padded_bmm")
DEFAULT_OUT = Path(__file__).parent / "results" / "worker_bench.json"


def median(values: list[float]) -> float:
    return statistics.median(values)


def machine() -> dict:
    info = {"cpu": platform.processor() or platform.machine(), "logical_cpus": os.cpu_count()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        fields = dict(
            line.split(":", 1) for line in text.splitlines() if ":" in line and not line.startswith(" ")
        )
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        info["cpu"] = fields.get("model name", info["cpu"])
        flags = set(fields.get("flags", "").split())
        info["avx512f"] = "avx512f" in flags
        info["avx512_bf16"] = "avx512_bf16" in flags
        info["amx_bf16"] = "amx_bf16" in flags
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()
        info["mem_gib"] = round(int(mem[1]) / 2**20, 1)
    except OSError:
        pass
    info["torch"] = torch.__version__
    info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    info["torch_threads"] = torch.get_num_threads()
    return info


class CpuMonitor:
    """CPU time the rest of the machine used while this process measured (other users' tests
    running at the same time slow every figure; this says how much they did)."""

    def __init__(self) -> None:
        self._hz = os.sysconf("SC_CLK_TCK")
        self._start = self._read()

    def _read(self) -> tuple[float, float, float]:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            busy = (sum(fields[:8]) - fields[3] - fields[4]) / self._hz  # all but idle and iowait
        except OSError:
            busy = float("nan")
        return time.perf_counter(), busy, time.process_time()

    def others_share(self) -> float:
        """Share of the machine's CPUs (0..1) used by other processes since construction."""
        wall0, busy0, own0 = self._start
        wall1, busy1, own1 = self._read()
        others = (busy1 - busy0) - (own1 - own0)
        return max(0.0, others / ((wall1 - wall0) * (os.cpu_count() or 1)))


def loadavg() -> float | None:
    """1-minute load average: other processes on the machine disturb every timing here."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return None


# -- memory bandwidth --------------------------------------------------------------------------


def measure_bandwidth(mib: int, repeats: int) -> dict:
    """Read bandwidth (``sum`` over a ``mib`` MiB float32 tensor) and copy bandwidth (read +
    write bytes of a ``mib`` MiB copy), medians of ``repeats``, in GB/s (10^9 bytes)."""
    n = mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    src.sum()
    dst.copy_(src)  # touch every page first
    read, copy = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        src.sum()
        read.append(time.perf_counter() - t)
        t = time.perf_counter()
        dst.copy_(src)
        copy.append(time.perf_counter() - t)
    return {
        "tensor_mib": mib,
        "read_gb_s": nbytes / median(read) / 1e9,
        "copy_gb_s": 2 * nbytes / median(copy) / 1e9,
    }


# -- engine runs --------------------------------------------------------------------------------


@dataclass
class EngineRun:
    """One engine with a batch of requests admitted and prefilled, stepped one decode at a time."""

    name: str
    engine: Engine
    prefill_s: float
    step_s: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        name: str,
        model: LlamaModel,
        loaded: LoadedModel,
        prompts: list[tuple[int, ...]],
        max_tokens: int,
        adapters: list[HostAdapter],
        pool_mib: float,
    ) -> EngineRun:
        engine = Engine(
            model,
            EngineConfig(pool_mib=pool_mib, max_running=len(prompts), lora_backend="torch"),
            eos_token_ids=loaded.config.eos_token_ids,
        )
        for adapter in adapters:
            engine.add_adapter(adapter)
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            adapter_id = adapters[i % len(adapters)].adapter_id if adapters else None
            engine.submit(GenerationRequest(f"{name}-{i}", prompt, sampling, adapter_id), lambda event: None)
        model.lora_backend = "torch"
        t = time.perf_counter()
        produced = engine.step()
        prefill_s = time.perf_counter() - t
        if produced != len(prompts) or len(engine.running) != len(prompts):
            raise RuntimeError(f"{name}: the prefill step admitted {len(engine.running)} of {len(prompts)}")
        return cls(name, engine, prefill_s)

    def step(self, backend: str, record: bool = True) -> float:
        """One decode step of the whole batch with ``backend``; returns its wall time."""
        self.engine.model.lora_backend = backend
        batch = len(self.engine.running)
        t = time.perf_counter()
        produced = self.engine.step()
        elapsed = time.perf_counter() - t
        if produced != batch:
            raise RuntimeError(f"{self.name}: a decode step produced {produced} tokens for {batch} requests")
        if record:
            self.step_s.setdefault(backend, []).append(elapsed)
        return elapsed


def make_prompts(loaded: LoadedModel, batch: int, prompt_len: int) -> list[tuple[int, ...]]:
    """``batch`` distinct prompts of exactly ``prompt_len`` tokens of real text."""
    text = (
        "The unified pool holds key and value pages of every running request next to the weight "
        "pages of the adapters they use, so idle adapters make room for longer contexts and the "
        "other way round. Requests arrive at any time and join the running batch at the next "
        "iteration; each one names the adapter it wants, and the batch mixes many adapters. "
    ) * 8
    ids = loaded.tokenizer.encode(text)
    if len(ids) < batch + prompt_len:
        raise ValueError("prompt text too short")
    return [tuple(ids[i : i + prompt_len]) for i in range(batch)]


# -- 1. base decode: engine vs HF generate -----------------------------------------------------


def hf_model(loaded: LoadedModel, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**loaded.config.to_hf_config()))
    model.load_state_dict(loaded.weights, strict=False)
    model.tie_weights()
    return model.to(dtype).eval()


def hf_generate(model, input_ids: torch.Tensor, new_tokens: int, pad_id: int) -> tuple[float, torch.Tensor]:
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - t
    if out.shape[1] != input_ids.shape[1] + new_tokens:
        raise RuntimeError(f"HF generate made {out.shape[1] - input_ids.shape[1]} tokens, not {new_tokens}")
    return elapsed, out[:, input_ids.shape[1] :]


def base_decode(loaded, model, dtype, prompts, new_tokens: int, repeats: int, log) -> dict:
    batch = len(prompts)
    decode_tokens = batch * (new_tokens - 1)  # the first token of each request comes from the prefill
    hf = hf_model(loaded, dtype)
    input_ids = torch.tensor(prompts, dtype=torch.int64)
    pad_id = loaded.config.eos_token_ids[0] if loaded.config.eos_token_ids else 0
    hf_generate(hf, input_ids[:, :8], 2, pad_id)  # warm-up
    engine_runs, hf_runs = [], []
    first_token_agreement = None
    for r in range(repeats):
        gc.collect()
        outputs: dict[str, list[int]] = {}
        engine = Engine(
            model,
            EngineConfig(pool_mib=256, max_running=batch, lora_backend="torch"),
            eos_token_ids=loaded.config.eos_token_ids,
        )
        sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.submit(
                GenerationRequest(f"base-{i}", prompt, sampling),
                lambda event, outputs=outputs: outputs.setdefault(event.request_id, []).append(
                    event.token_id
                ),
            )
        model.lora_backend = "torch"
        monitor = CpuMonitor()
        t = time.perf_counter()
        engine.step()
        prefill_s = time.perf_counter() - t
        steps = []
        while engine.has_work():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        if len(steps) != new_tokens - 1:
            raise RuntimeError(f"engine ran {len(steps)} decode steps, expected {new_tokens - 1}")
        engine_runs.append(
            {
                "prefill_s": prefill_s,
                "decode_s": sum(steps),
                "median_step_s": median(steps),
                "decode_tok_s": decode_tokens / sum(steps),
                "others_cpu_share": monitor.others_share(),
            }
        )
        log(
            f"  engine run {r + 1}: prefill {prefill_s:.1f} s, decode {sum(steps):.1f} s, "
            f"{decode_tokens / sum(steps):.0f} tok/s, others' CPU {100 * engine_runs[-1]['others_cpu_share']:.0f}%"
        )
        gc.collect()
        monitor = CpuMonitor()
        full_s, hf_tokens = hf_generate(hf, input_ids, new_tokens, pad_id)
        prefill_only_s, _ = hf_generate(hf, input_ids, 1, pad_id)
        hf_runs.append(
            {
                "generate_s": full_s,
                "generate_1_s": prefill_only_s,
                "decode_s": full_s - prefill_only_s,
                "decode_tok_s": decode_tokens / (full_s - prefill_only_s),
                "others_cpu_share": monitor.others_share(),
            }
        )
        log(
            f"  HF run {r + 1}: generate({new_tokens}) {full_s:.1f} s, generate(1) {prefill_only_s:.1f} s, "
            f"{decode_tokens / (full_s - prefill_only_s):.0f} tok/s, "
            f"others' CPU {100 * hf_runs[-1]['others_cpu_share']:.0f}%"
        )
        if first_token_agreement is None:
            # Sanity: both greedy-decode the same model (bf16 rounding may split near-ties later).
            ours = [outputs[f"base-{i}"][0] for i in range(batch)]
            first_token_agreement = sum(int(a == b) for a, b in zip(ours, hf_tokens[:, 0].tolist())) / batch
    engine_tok_s = median([run["decode_tok_s"] for run in engine_runs])
    hf_tok_s = median([run["decode_tok_s"] for run in hf_runs])
    return {
        "batch": batch,
        "prompt_len": len(prompts[0]),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "engine_decode_tok_s": engine_tok_s,
        "hf_decode_tok_s": hf_tok_s,
        "ratio": engine_tok_s / hf_tok_s,
        "engine_median_step_ms": 1e3 * median([run["median_step_s"] for run in engine_runs]),
        "hf_mean_step_ms": 1e3 * median([run["decode_s"] for run in hf_runs]) / (new_tokens - 1),
        "first_token_agreement": first_token_agreement,
        "engine_runs": engine_runs,
        "hf_runs": hf_runs,
    }


# -- 2 and 3. adapters ---------------------------------------------------------------------------


def make_adapters(count: int, dtype: torch.dtype, root: Path) -> list[HostAdapter]:
    spec = load_base_model_spec()
    dtype_name = str(dtype).removeprefix("torch.")
    adapters = []
    for i in range(count):
        sample = SampleAdapterSpec(
            rank=RANKS[i % len(RANKS)], target_modules=LORA_TARGETS, dtype=dtype_name, seed=100 + i
        )
        files = adapter_files(write_peft_adapter(root / f"a{i}", spec, sample))
        adapters.append(
            parse_peft_adapter(
                f"a{i}-r{sample.rank}",
                files["adapter_config.json"],
                files["adapter_model.safetensors"],
                dtype,
            )
        )
    return adapters


def adapter_rounds(
    loaded, model, prompts, adapters, ks: list[int], warmup: int, rounds: int, others: list[float], log
) -> dict[str, EngineRun]:
    max_tokens = 2 * (warmup + rounds) + 4
    kv_mib = 64  # 32 requests x ~100 tokens x 30 layers x K+V of 192 bf16 values is ~70 MB
    runs = {"k0": EngineRun.start("k0", model, loaded, prompts, max_tokens, [], kv_mib * 2)}
    log(f"  prefilled k0 in {runs['k0'].prefill_s:.1f} s")
    for k in ks:
        chosen = adapters[:k]
        mib = kv_mib * 2 + 1.3 * sum(a.nbytes for a in chosen) / 2**20
        runs[f"k{k}"] = EngineRun.start(f"k{k}", model, loaded, prompts, max_tokens, chosen, mib)
        log(f"  prefilled k{k} in {runs[f'k{k}'].prefill_s:.1f} s")
    for r in range(warmup + rounds):
        record = r >= warmup
        order = BACKENDS if r % 2 == 0 else BACKENDS[::-1]
        monitor = CpuMonitor()
        t = time.perf_counter()
        for name, run in runs.items():
            if name == "k0":
                run.step("torch", record)
                run.step("torch", record)
            else:
                for backend in order:
                    run.step(backend, record)
        log(
            f"  round {r + 1}/{warmup + rounds}{'' if record else ' (warm-up)'}: "
            f"{time.perf_counter() - t:.1f} s, other processes used {100 * monitor.others_share():.0f}% CPU"
        )
        if record:
            others.append(monitor.others_share())
    return runs


def adapter_figures(runs: dict[str, EngineRun], adapters, ks, bandwidth_gb_s: float) -> tuple[list, list]:
    base_ms = 1e3 * median(runs["k0"].step_s["torch"])
    overhead, backends = [], []
    for k in ks:
        run = runs[f"k{k}"]
        gather_ms = 1e3 * median(run.step_s["torch"])
        bmm_ms = 1e3 * median(run.step_s["padded_bmm"])
        nbytes = sum(a.nbytes for a in adapters[:k])
        bound_ms = 1e3 * nbytes / (bandwidth_gb_s * 1e9)
        extra_ms = gather_ms - base_ms
        overhead.append(
            {
                "k": k,
                "ranks": sorted({a.max_rank for a in adapters[:k]}),
                "base_step_ms": base_ms,
                "step_ms": gather_ms,
                "extra_ms": extra_ms,
                "adapter_mb": nbytes / 1e6,
                "bound_ms": bound_ms,
                "extra_over_bound": extra_ms / bound_ms,
            }
        )
        backends.append(
            {
                "k": k,
                "gather_step_ms": gather_ms,
                "padded_bmm_step_ms": bmm_ms,
                "gather_extra_ms": extra_ms,
                "padded_bmm_extra_ms": bmm_ms - base_ms,
                "bmm_over_gather": bmm_ms / gather_ms,
            }
        )
    return overhead, backends


# -- profile -------------------------------------------------------------------------------------

BASE_DIMS = {576, 960, 1536, 3072, 49152, 192}


def _is_base_matmul(shapes) -> bool:
    """An ``aten::mm`` whose second operand has only base-model dimensions (not a LoRA rank)."""
    if len(shapes) < 2 or len(shapes[1]) != 2:
        return False
    return all(d in BASE_DIMS for d in shapes[1])


def profile_step(run: EngineRun, backend: str) -> dict:
    """Profile one decode step and split its wall time by kind of work."""
    from torch.profiler import ProfilerActivity, profile

    run.engine.model.lora_backend = backend
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t = time.perf_counter()
        run.engine.step()
        wall = time.perf_counter() - t
    buckets = {"base_matmul": 0.0, "lora_matmul": 0.0, "attention": 0.0, "other_ops": 0.0}
    calls = 0
    for event in prof.events():
        self_s = event.self_cpu_time_total / 1e6
        if not event.name.startswith("aten::"):
            continue
        calls += 1
        if event.name in ("aten::mm", "aten::addmm"):
            buckets["base_matmul" if _is_base_matmul(event.input_shapes) else "lora_matmul"] += self_s
        elif event.name == "aten::bmm":
            buckets["lora_matmul"] += self_s
        elif "scaled_dot_product" in event.name:
            buckets["attention"] += self_s
        else:
            buckets["other_ops"] += self_s
    ops_s = sum(buckets.values())
    buckets["python_and_framework"] = max(0.0, wall - ops_s)
    return {
        "backend": backend,
        "wall_ms": 1e3 * wall,
        "aten_calls": calls,
        "ms": {name: 1e3 * s for name, s in buckets.items()},
        "share": {name: s / wall for name, s in buckets.items()},
        "top_ops": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12),
    }


# -- report --------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    base = result["base_decode"]
    bw = result["bandwidth"]
    m = result["machine"]
    engine_others = max(r["others_cpu_share"] for r in base["engine_runs"])
    hf_others = max(r["others_cpu_share"] for r in base["hf_runs"])
    rounds_others = max(result["rounds_others_cpu_share"], default=0.0)
    lines = [
        (
            f"Machine: {m['cpu']}, {m['logical_cpus']} CPUs, avx512_bf16={m.get('avx512_bf16')}, "
            f"torch {m['torch']} ({m['torch_cpu_capability']}), {result['threads']} threads, {result['dtype']}"
        ),
        (
            f"Memory bandwidth: read {bw['read_gb_s']:.1f} GB/s (sum of {bw['tensor_mib']} MiB), "
            f"copy {bw['copy_gb_s']:.1f} GB/s (read + write)"
        ),
        (
            "CPU used by other processes while measuring (share of all CPUs, max over runs/rounds): "
            f"bandwidth {100 * bw['others_cpu_share']:.0f}%, engine runs {100 * engine_others:.0f}%, "
            f"HF runs {100 * hf_others:.0f}%, adapter rounds {100 * rounds_others:.0f}%"
        ),
        "",
        (
            f"**1. Base decode, batch {base['batch']}, prompt {base['prompt_len']}, "
            f"{base['new_tokens']} new tokens, no adapters** (median of {base['repeats']} runs)"
        ),
        "",
        "| | decode tok/s | step ms |",
        "|---|---|---|",
        f"| engine | {base['engine_decode_tok_s']:.0f} | {base['engine_median_step_ms']:.0f} |",
        f"| HF generate | {base['hf_decode_tok_s']:.0f} | {base['hf_mean_step_ms']:.0f} |",
        f"| **engine / HF** | **{base['ratio']:.2f}×** (target ≥ 1.3×) | |",
        "",
        f"first generated token equal to HF's for {100 * base['first_token_agreement']:.0f}% of requests",
        "",
        (
            "**2. Adapter overhead, batch 32 decode, gather path (`torch`)** "
            f"(median of {result['rounds']} interleaved steps each)"
        ),
        "",
        "| k adapters | step ms | no-adapter step ms | extra ms | adapter MB | bound ms | extra / bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["adapter_overhead"]:
        target = " (target ≤ 2)" if row["k"] >= 8 else ""
        lines.append(
            f"| {row['k']} | {row['step_ms']:.0f} | {row['base_step_ms']:.0f} | {row['extra_ms']:.1f} | "
            f"{row['adapter_mb']:.1f} | {row['bound_ms']:.2f} | {row['extra_over_bound']:.1f}{target} |"
        )
    lines += [
        "",
        "**3. Gather path vs padded bmm, same mixed-rank batch**",
        "",
        "| k adapters | gather step ms | padded bmm step ms | gather extra ms | bmm extra ms | bmm / gather |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["backends"]:
        lines.append(
            f"| {row['k']} | {row['gather_step_ms']:.0f} | {row['padded_bmm_step_ms']:.0f} | "
            f"{row['gather_extra_ms']:.1f} | {row['padded_bmm_extra_ms']:.1f} | {row['bmm_over_gather']:.2f} |"
        )
    if result.get("profiles"):
        lines += [
            "",
            "**Profile of one decode step (torch.profiler, self CPU time; profiler overhead included)**",
            "",
            "| step | wall ms | aten calls | base matmul | LoRA matmul | attention | other ops | Python/framework |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, prof in result["profiles"].items():
            ms = prof["ms"]
            cells = " | ".join(
                f"{ms[key]:.0f} ({100 * prof['share'][key]:.0f}%)"
                for key in ("base_matmul", "lora_matmul", "attention", "other_ops", "python_and_framework")
            )
            lines.append(f"| {name} | {prof['wall_ms']:.0f} | {prof['aten_calls']} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens, repeats and rounds (~3 min)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=None, help="part 1 (default 64; quick 16)")
    parser.add_argument("--repeats", type=int, default=None, help="part 1 runs (default 2; quick 1)")
    parser.add_argument("--rounds", type=int, default=None, help="parts 2-3 rounds (default 12; quick 4)")
    parser.add_argument("--ks", default="1,8,32", help="numbers of distinct adapters")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    new_tokens = args.new_tokens or (16 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 2)
    rounds = args.rounds or (4 if args.quick else 12)
    warmup = 1 if args.quick else 2
    ks = [int(k) for k in args.ks.split(",")]
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {message}", flush=True)

    result: dict = {
        "command": "bench/worker_bench.py" + (" --quick" if args.quick else ""),
        "dtype": args.dtype,
        "threads": args.threads,
        "machine": machine(),
        "loadavg_start": loadavg(),
    }
    log(f"machine: {result['machine']}")
    monitor = CpuMonitor()
    result["bandwidth"] = measure_bandwidth(1024, 5)
    result["bandwidth"]["others_cpu_share"] = monitor.others_share()
    log(f"bandwidth: {result['bandwidth']}")

    loaded = load_model()
    model = LlamaModel(loaded.config, loaded.weights, dtype)
    prompts = make_prompts(loaded, args.batch, args.prompt_len)

    log(f"1. base decode: engine vs HF generate, {new_tokens} new tokens, {repeats} run(s)")
    result["base_decode"] = base_decode(loaded, model, dtype, prompts, new_tokens, repeats, log)

    log(f"2-3. adapters: writing {max(ks)} adapters")
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(max(ks), dtype, Path(tmp))
    gc.collect()
    others: list[float] = []
    runs = adapter_rounds(loaded, model, prompts, adapters, ks, warmup, rounds, others, log)
    result["rounds_others_cpu_share"] = others
    result["rounds"] = rounds
    result["warmup_rounds"] = warmup
    overhead, backends = adapter_figures(runs, adapters, ks, result["bandwidth"]["read_gb_s"])
    result["adapter_overhead"] = overhead
    result["backends"] = backends
    result["prefill_s"] = {name: run.prefill_s for name, run in runs.items()}
    result["step_s"] = {name: run.step_s for name, run in runs.items()}

    if not args.no_profile:
        log("profiling one decode step")
        biggest = f"k{max(ks)}"
        result["profiles"] = {
            "no adapter": profile_step(runs["k0"], "torch"),
            f"{biggest} gather": profile_step(runs[biggest], "torch"),
            f"{biggest} padded bmm": profile_step(runs[biggest], "padded_bmm"),
        }
    result["loadavg_end"] = loadavg()
    result["elapsed_s"] = time.perf_counter() - started

    table = markdown(result)
    print()
    print(table)
    if result.get("profiles"):
        for name, prof in result["profiles"].items():
            print(f"\n{name}:\n{prof['top_ops']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result["markdown"] = table
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
