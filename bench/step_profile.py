"""Where one engine decode step's time goes on this machine, next to its roofline (issue 27).

    .venv/bin/python -m bench.step_profile                    # batch 1, 8, 32; fp32 weights
    .venv/bin/python -m bench.step_profile --dtype bfloat16
    .venv/bin/python -m bench.step_profile --quick            # a short run

For each decode batch (every request with its own rank-16 adapter on all seven projections, and
the same batch without adapters) the real ``Engine.step`` runs with wall-clock timers wrapped,
for this process only, around the calls it makes: the base model's linear layers (lm_head
included), the LoRA deltas, attention with its rotary embedding and KV writes, and sampling. The forward pass's
remainder is norms/rope/activation/other; the step's remainder outside the forward pass is
planning (scheduling, building the step's batch, bookkeeping). Untimed steps alternate with the
timed ones, so the timers' own cost shows as the difference of the two step times.

The roofline: read bandwidth (``sum`` over a large tensor, one thread and all threads) and the
GEMM peak of fp32 and bf16 (a large ``torch.mm``). Each row sets the bytes a step must read
(base weights, and the adapters of its requests) against the step time and the measured
bandwidth, and its FLOPs against the GEMM peak of the weights' dtype.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.out_dir import default_out
from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from bench.worker_bench import machine, make_prompts
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine import step_sampling
from services.gpu_worker.engine.engine import Engine
from services.gpu_worker.engine.engine_config import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest, SamplingParams
from services.gpu_worker.lora.host_adapter import HostAdapter, parse_peft_adapter
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import LoadedModel, load_model
from services.gpu_worker.model.native_step_ops import NativeStepOps
from services.gpu_worker.model.quantized_weight import QuantizedWeight
from services.gpu_worker.model.step_ops import TorchStepOps
from services.model_files.base_model import BaseModelSpec, load_base_model_spec
from services.model_files.peft_format import LORA_TARGETS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
COMPONENTS = ("planning", "base_gemm", "lora", "attention", "other", "sampling")
"""A step's parts, in the order the table shows them; they sum to the (timed) step."""
ADAPTER_RANK = 16


# -- results --------------------------------------------------------------------------------------


@dataclass
class Roofline:
    """What this machine can do at best: read bandwidth (GB/s, 10^9 bytes) and GEMM peaks (GFLOP/s)."""

    read_gb_s_one_thread: float
    read_gb_s_all_threads: float
    gemm_gflop_s: dict[str, float]
    """Per dtype name (``float32``, ``bfloat16``): a large square ``torch.mm`` on all threads."""
    threads: int

    @property
    def read_gb_s(self) -> float:
        """The best read bandwidth measured: what a step's bytes are set against."""
        return max(self.read_gb_s_one_thread, self.read_gb_s_all_threads)


@dataclass
class StepProfile:
    """One configuration's median decode step, split into :data:`COMPONENTS`."""

    batch: int
    adapters: int
    step_ms: float
    """Median step without the timers."""
    timed_step_ms: float
    """Median step with the timers; ``components_ms`` sums to it."""
    components_ms: dict[str, float]
    weight_bytes: int
    """Base weights read per step (every projection, the norms, lm_head)."""
    adapter_bytes: int
    """The adapters' rows read per step (each distinct adapter once)."""
    flops: float
    """2 × multiply-adds of the base and LoRA matmuls (attention's are left out: small at these contexts)."""
    bandwidth_share: float
    """(weight + adapter bytes) / step time, over the best read bandwidth (:attr:`Roofline.read_gb_s`)."""
    flops_share: float
    """FLOPs / step time, over the GEMM peak of the weights' dtype."""
    base_gemm_bandwidth_share: float
    """Base weight bytes / base GEMM time, over the best read bandwidth (:attr:`Roofline.read_gb_s`)."""
    lora_bandwidth_share: float
    """Adapter bytes / LoRA time, over the best read bandwidth (0 without adapters)."""


@dataclass
class ProfileReport:
    """A whole run: the machine, its roofline and one profile per configuration."""

    machine: dict
    dtype: str
    roofline: Roofline
    context_tokens: int
    """Prompt tokens of each request at the first measured step."""
    steps: int
    profiles: list[StepProfile] = field(default_factory=list)


# -- roofline -------------------------------------------------------------------------------------


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def read_bandwidth(mib: int, repeats: int) -> float:
    """GB/s of ``sum`` over a ``mib`` MiB float32 tensor, best of ``repeats`` (the machine is shared:
    the best run is the one least disturbed)."""
    tensor = torch.ones(mib * 2**20 // 4)
    tensor.sum()  # touch every page first
    best = min(_seconds(tensor.sum) for _ in range(repeats))
    return tensor.numel() * tensor.element_size() / best / 1e9


def gemm_peak(dtype: torch.dtype, size: int, repeats: int) -> float:
    """GFLOP/s of ``torch.mm`` of two ``size`` × ``size`` matrices, best of ``repeats``."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    best = min(_seconds(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * size**3 / best / 1e9


def measure_roofline(mib: int, gemm_size: int, repeats: int) -> Roofline:
    threads = torch.get_num_threads()
    with torch_threads(1):
        one = read_bandwidth(mib, repeats)
    return Roofline(
        read_gb_s_one_thread=one,
        read_gb_s_all_threads=read_bandwidth(mib, repeats),
        gemm_gflop_s={name: gemm_peak(dtype, gemm_size, repeats) for name, dtype in DTYPES.items()},
        threads=threads,
    )


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- the model and its adapters ---------------------------------------------------------------------


def build_model(loaded: LoadedModel, dtype: torch.dtype) -> LlamaModel:
    """The model whose steps are profiled: unquantized base weights in ``dtype``, quantized ones
    (``load_model(quantization=...)``) as their blocks."""
    return LlamaModel(loaded.config, loaded.weights, dtype)


def weight_bytes(model: LlamaModel) -> int:
    """Bytes of base weights one step reads: every layer's matrices and norms, the final norm and
    lm_head (the embedding rows a step gathers are negligible next to it)."""
    tensors = [model.norm, model.lm_head]
    for layer in model.layers:
        tensors += [layer.qkv, layer.o, layer.gate_up, layer.down, layer.input_norm, layer.post_norm]
        if layer.qkv_bias is not None:
            tensors.append(layer.qkv_bias)
    return sum(t.nbytes if isinstance(t, QuantizedWeight) else t.numel() * t.element_size() for t in tensors)


def base_multiply_adds(model: LlamaModel) -> int:
    """Multiply-adds of the base linear layers (lm_head included) for one token."""
    matrices = [model.lm_head] + [
        w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    return sum(w.numel() for w in matrices)


def make_adapters(count: int, spec: BaseModelSpec, dtype: torch.dtype, root: Path) -> list[HostAdapter]:
    """``count`` distinct rank-16 PEFT adapters on all seven projections, parsed as the worker does."""
    dtype_name = str(dtype).removeprefix("torch.")
    adapters = []
    for i in range(count):
        sample = SampleAdapterSpec(
            rank=ADAPTER_RANK, target_modules=LORA_TARGETS, dtype=dtype_name, seed=100 + i
        )
        files = adapter_files(write_peft_adapter(root / f"a{i}", spec, sample))
        adapters.append(
            parse_peft_adapter(
                f"a{i}", files["adapter_config.json"], files["adapter_model.safetensors"], dtype
            )
        )
    return adapters


def lora_multiply_adds(spec: BaseModelSpec) -> int:
    """Multiply-adds of one adapter's deltas for one token (= its weights' element count)."""
    per_layer = sum(ADAPTER_RANK * sum(spec.projection_shape(m)) for m in LORA_TARGETS)
    return spec.num_layers * per_layer


# -- timing one step ------------------------------------------------------------------------------


class StepTimers:
    """Wall-clock timers wrapped around the calls of one engine's steps, for this process only."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, component: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[component] += time.perf_counter() - start

        return timed

    @contextmanager
    def installed(self, engine: Engine) -> Iterator[None]:
        """The timers around ``engine``'s calls; everything is put back on exit.

        Instance attributes shadow the model's methods (``forward`` looks them up on ``self`` every
        step); the step ops' methods are wrapped on their classes (an ops object lives one step);
        ``sample_batch`` is a module global of the engine's step sampling."""
        model = engine.executor.model
        saved_sample = step_sampling.sample_batch
        saved_ops = {
            (cls, name): cls.__dict__[name]
            for cls in (TorchStepOps, NativeStepOps)
            for name in ("linear", "rotate_and_cache", "attention")
        }
        parts = {"linear": "base_gemm", "rotate_and_cache": "attention", "attention": "attention"}
        for (cls, name), method in saved_ops.items():
            setattr(cls, name, self.wrap(parts[name], method))
        model._lora = self.wrap("lora", LlamaModel._lora)
        model.forward = self.wrap("forward", model.forward)
        step_sampling.sample_batch = self.wrap("sampling", saved_sample)
        try:
            yield
        finally:
            step_sampling.sample_batch = saved_sample
            for (cls, name), method in saved_ops.items():
                setattr(cls, name, method)
            for name in ("_lora", "forward"):
                delattr(model, name)

    def components(self, step_s: float) -> dict[str, float]:
        """The step's :data:`COMPONENTS` in seconds: the forward pass's remainder is ``other``, the
        step's remainder outside the forward pass and sampling is ``planning``."""
        s = self.seconds
        timed_in_forward = s["base_gemm"] + s["lora"] + s["attention"]
        return {
            "planning": max(0.0, step_s - s["forward"] - s["sampling"]),
            "base_gemm": s["base_gemm"],
            "lora": s["lora"],
            "attention": s["attention"],
            "other": max(0.0, s["forward"] - timed_in_forward),
            "sampling": s["sampling"],
        }


def start_engine(
    model: LlamaModel, prompts: list[tuple[int, ...]], adapters: list[HostAdapter | None], max_tokens: int
) -> Engine:
    """An engine with one request per prompt (request i on ``adapters[i]``), prefilled."""
    engine = local_engine(
        model,
        EngineConfig(
            pool_mib=_pool_mib(model, prompts, adapters, max_tokens),
            max_running=len(prompts),
            speculative="off",  # the profile is of plain decode steps: one token a request each
        ),
    )
    for adapter in {a.adapter_id: a for a in adapters if a is not None}.values():
        engine.add_adapter(adapter)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        request = GenerationRequest(f"r{i}", prompt, sampling, adapter.adapter_id if adapter else None)
        engine.submit(request, lambda event: None)
    engine.step()
    if len(engine.running) != len(prompts):
        raise RuntimeError(f"the prefill step admitted {len(engine.running)} of {len(prompts)} requests")
    return engine


def _pool_mib(model: LlamaModel, prompts, adapters, max_tokens: int) -> float:
    """Room for every request's KV to its last token and every adapter's rows, with slack."""
    cfg = model.config
    element = torch.tensor([], dtype=model.dtype).element_size()
    kv_values = (
        sum(len(p) + max_tokens + 32 for p in prompts) * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    )
    rows = sum(a.nbytes for a in adapters if a is not None)
    return 2 * (kv_values * element + rows) / 2**20 + 16


def profile_batch(
    model: LlamaModel,
    prompts: list[tuple[int, ...]],
    adapters: list[HostAdapter | None],
    steps: int,
    warmup: int,
) -> tuple[float, float, dict[str, float]]:
    """Median untimed step, median timed step and that step's components (seconds)."""
    engine = start_engine(model, prompts, adapters, max_tokens=2 * (steps + warmup) + 4)
    batch = len(prompts)
    plain, timed = [], []
    for index in range(warmup + steps):
        plain_s = _seconds(engine.step)
        timers = StepTimers()
        with timers.installed(engine):
            start = time.perf_counter()
            produced = engine.step()
            timed_s = time.perf_counter() - start
        if produced != batch:
            raise RuntimeError(f"a decode step produced {produced} tokens for {batch} requests")
        if index >= warmup:
            plain.append(plain_s)
            timed.append((timed_s, timers.components(timed_s)))
    # The median timed step's own parts, so they add up to it.
    timed_s, parts = sorted(timed, key=lambda step: step[0])[len(timed) // 2]
    return statistics.median(plain), timed_s, parts


# -- the run --------------------------------------------------------------------------------------


def run_profile(
    loaded: LoadedModel,
    spec: BaseModelSpec,
    dtype: torch.dtype,
    batches: list[int],
    prompt_len: int,
    steps: int,
    warmup: int,
    roofline: Roofline,
) -> ProfileReport:
    """Profiles of every batch in ``batches``, with one adapter per request and without adapters."""
    model = build_model(loaded, dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    report = ProfileReport(machine(), dtype_name, roofline, prompt_len, steps)
    base_bytes = weight_bytes(model)
    base_macs = base_multiply_adds(model)
    adapter_macs = lora_multiply_adds(spec)
    bandwidth = roofline.read_gb_s * 1e9
    peak = roofline.gemm_gflop_s[dtype_name] * 1e9
    with tempfile.TemporaryDirectory() as root:
        all_adapters = make_adapters(max(batches), spec, dtype, Path(root))
        for batch in batches:
            prompts = _prompts(loaded, batch, prompt_len)
            for with_adapters in (False, True):
                adapters = all_adapters[:batch] if with_adapters else [None] * batch
                step_s, timed_s, parts = profile_batch(model, prompts, adapters, steps, warmup)
                lora_bytes = sum(a.nbytes for a in adapters if a is not None)
                flops = 2 * batch * (base_macs + (adapter_macs if with_adapters else 0))
                report.profiles.append(
                    StepProfile(
                        batch=batch,
                        adapters=batch if with_adapters else 0,
                        step_ms=1e3 * step_s,
                        timed_step_ms=1e3 * timed_s,
                        components_ms={name: 1e3 * s for name, s in parts.items()},
                        weight_bytes=base_bytes,
                        adapter_bytes=lora_bytes,
                        flops=flops,
                        bandwidth_share=(base_bytes + lora_bytes) / step_s / bandwidth,
                        flops_share=flops / step_s / peak,
                        base_gemm_bandwidth_share=base_bytes / max(parts["base_gemm"], 1e-9) / bandwidth,
                        lora_bandwidth_share=lora_bytes / parts["lora"] / bandwidth if lora_bytes else 0.0,
                    )
                )
    return report


def _prompts(loaded: LoadedModel, batch: int, prompt_len: int) -> list[tuple[int, ...]]:
    """Real-text prompts where the tokenizer can make them; token ids otherwise (a tiny vocabulary)."""
    try:
        return make_prompts(loaded, batch, prompt_len)
    except ValueError:
        vocab = loaded.config.vocab_size
        return [tuple((i + j) % vocab for j in range(prompt_len)) for i in range(batch)]


def markdown(report: ProfileReport) -> str:
    """The roofline line and one table row per profile."""
    r = report.roofline
    m = report.machine
    lines = [
        (
            f"CPU: {m.get('cpu')} ({m.get('logical_cpus')} logical CPUs, avx512f {m.get('avx512f')}, "
            f"avx512_bf16 {m.get('avx512_bf16')}, torch capability {m.get('torch_cpu_capability')}), "
            f"{r.threads} threads, weights {report.dtype}, prompts of {report.context_tokens} tokens, "
            f"median of {report.steps} steps"
        ),
        (
            f"Roofline: read {r.read_gb_s_one_thread:.1f} GB/s (1 thread), {r.read_gb_s_all_threads:.1f} GB/s "
            f"(all); GEMM fp32 {r.gemm_gflop_s['float32']:.0f} GFLOP/s, bf16 {r.gemm_gflop_s['bfloat16']:.0f} GFLOP/s"
        ),
        "",
        (
            "| batch | adapters | step ms | timed ms | planning | base GEMM | LoRA | attention | other | sampling "
            "| MB read | of bandwidth | of FLOP peak | base GEMM of bw | LoRA of bw |"
        ),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in report.profiles:
        parts = " | ".join(f"{p.components_ms[name]:.2f}" for name in COMPONENTS)
        lines.append(
            f"| {p.batch} | {p.adapters} | {p.step_ms:.2f} | {p.timed_step_ms:.2f} | {parts} "
            f"| {(p.weight_bytes + p.adapter_bytes) / 1e6:.1f} | {p.bandwidth_share:.0%} | {p.flops_share:.1%} "
            f"| {p.base_gemm_bandwidth_share:.0%} | {p.lora_bandwidth_share:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dtype", default="float32", choices=sorted(DTYPES), help="storage and compute dtype"
    )
    parser.add_argument("--quantization", default="none", choices=["none", "q8_0", "q4_1"],
                        help="base weights' block format (the worker's --quantization)")  # fmt: skip
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="measured decode steps per configuration")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="few steps, a small roofline")
    parser.add_argument("--out", type=Path, default=default_out("step_profile"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 4, 1
    torch.manual_seed(0)
    roofline = measure_roofline(
        mib=256 if args.quick else 1024,
        gemm_size=1024 if args.quick else 2048,
        repeats=3 if args.quick else 7,
    )
    loaded = load_model(quantization=args.quantization)
    report = run_profile(
        loaded,
        load_base_model_spec(),
        DTYPES[args.dtype],
        args.batches,
        args.prompt_len,
        args.steps,
        args.warmup,
        roofline,
    )
    table = markdown(report)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    (args.out / f"{stamp}-{args.dtype}-{args.quantization}.json").write_text(
        json.dumps(asdict(report), indent=2)
    )
    (args.out / f"{stamp}-{args.dtype}-{args.quantization}.md").write_text(table + "\n")
    print(f"wrote {args.out}/{stamp}-{args.dtype}-{args.quantization}.json")


if __name__ == "__main__":
    main()
