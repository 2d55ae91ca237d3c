"""gpu_worker engine speed on CPU: base decode against HF ``generate``, LoRA adapter overhead
against the memory-bandwidth bound, and the gather path against padded bmm (issue 3).

    PYTHONPATH=. .venv/bin/python bench/worker_bench.py            # full run (~5 min)
    PYTHONPATH=. .venv/bin/python bench/worker_bench.py --quick    # short run (~1.5 min)

Everything runs in one process, on the default base model (SmolLM2-135M-Instruct), in bf16
(``--dtype``) with ``--threads`` torch threads (2). The engine stores weights, KV cache and
adapters in that dtype and computes in the model's resolved compute dtype (fp32 on a CPU without
bf16 GEMM units, see ``model/compute_dtype.py``); HF computes in ``--dtype``. Figures are ratios measured side by side in
this one run; no timing is asserted anywhere. Results: a markdown table on stdout and
``bench/out/worker_bench/results.json``.

1. Base decode, batch 32, no adapters: the engine (32 requests of the same prompt length,
   ``ignore_eos``; only the decode steps are timed, the prefill step is not) against HF
   ``LlamaForCausalLM.generate`` on the same weights (decode time = ``generate(new_tokens)``
   minus ``generate(1)``, i.e. minus the prefill and its token). Runs alternate engine / HF. A
   cross-check times every decode step of both (HF's through a stopping criterion that only
   reads the clock) and compares median steps.
2. Adapter overhead: batch 32 decode with k = 1, 8, 32 distinct adapters (ranks 8/16/32/64
   round-robin, all seven projections, bf16), requests spread round-robin over the k adapters.
   The extra step time over the no-adapter step time is set against a bound: the bytes of the k
   adapters' weights (each read once per decode step) / the read bandwidth measured at the start.
   A second ratio takes each round's extra against the bandwidth read in that round (a 256 MiB
   ``sum`` right before the engine's steps), since the host's speed drifts during the run.
3. The same batches with each LoRA backend side by side: ``cpu_native`` (the C kernel, the
   engine's CPU default), ``torch`` (the torch gather path, by runs of rows) and ``padded_bmm``
   (S-LoRA's bmm ablation baseline).

For 2 and 3 one engine per k and a twin without adapters are prefilled, then stepped in rounds:
each round steps every adapter engine once per backend (the order alternating between rounds),
each step right after a step of its twin at the same context length. The extra time is the
median over rounds of (adapter step - twin step): the host drifts between a fast and a slow
regime on a scale of tens of seconds, which medians of separately taken steps would mix. The
backend is switched between steps through the engine's plans (``engine.lora_backend``, set
from ``EngineConfig.lora_backend``). Finally decode
steps without adapters and with the largest k are profiled (torch.profiler).

The machine may be shared: every timed step records the share of the CPUs other processes used
meanwhile (from /proc/stat), medians are taken over the steps where that share stayed under
10% when there are enough of them, and the report says how many there were.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.out_dir import default_out
from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.kernels.cpu_native import NativeCall
from services.gpu_worker.lora.host_adapter import HostAdapter, parse_peft_adapter
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import LoadedModel, load_model
from services.model_files.base_model import load_base_model_spec
from services.model_files.peft_format import LORA_TARGETS

RANKS = (8, 16, 32, 64)
BACKENDS = ("cpu_native", "torch", "padded_bmm")
"""LoRA backends stepped side by side; the first is the engine's default on this CPU (part 2)."""
GATHER = ("cpu_native", "torch")
"""The gather backends compared with padded bmm in part 3."""
NATIVE_LABEL = "loramesh::lora_cpu_native"
"""Profiler range around each native kernel call (its self time is the kernel's)."""
NO_ADAPTER = "auto"
ROUND_PROBE_MIB = 256
"""A read of this many MiB before each engine's steps of a round measures that round's bandwidth."""
"""Backend name the no-adapter engines step with (there is no LoRA work to dispatch)."""
DEFAULT_OUT = default_out("worker_bench") / "results.json"
QUIET = 0.10
"""A step is quiet when other processes used at most this share of the machine's CPUs during it."""


# -- the machine ----------------------------------------------------------------------------------


def machine() -> dict:
    info: dict = {"cpu": platform.processor() or platform.machine(), "logical_cpus": os.cpu_count()}
    try:
        pairs = (line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in pairs}
        info["cpu"] = fields.get("model name", info["cpu"])
        flags = set(fields.get("flags", "").split())
        for flag in ("avx512f", "avx512_bf16", "amx_bf16"):
            info[flag] = flag in flags
        info["mem_gib"] = round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)
    except OSError:
        pass
    info["torch"] = torch.__version__
    info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    info["torch_threads"] = torch.get_num_threads()
    return info


class CpuMonitor:
    """How much of the machine's CPUs other processes used between two readings (0..1).

    Other users' test suites running at the same time slow every figure here; this says how
    much, from the machine's busy time (/proc/stat) minus this process's CPU time.
    """

    def __init__(self) -> None:
        self._hz = os.sysconf("SC_CLK_TCK")
        self._cpus = os.cpu_count() or 1
        self._first = self._last = self._read()

    def _read(self) -> tuple[float, float, float]:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            busy = (sum(fields[:8]) - fields[3] - fields[4]) / self._hz  # all but idle and iowait
        except OSError:
            busy = float("nan")
        return time.perf_counter(), busy, time.process_time()

    def _share(self, since: tuple[float, float, float], now: tuple[float, float, float]) -> float:
        others = (now[1] - since[1]) - (now[2] - since[2])
        return max(0.0, others / max(1e-9, (now[0] - since[0]) * self._cpus))

    def tick(self) -> float:
        """Share since the previous tick (or construction)."""
        now = self._read()
        share, self._last = self._share(self._last, now), now
        return share

    def total(self) -> float:
        """Share since construction."""
        return self._share(self._first, self._read())


def wait_quiet(budget: dict, log) -> float:
    """Wait (up to what is left of ``budget["wait_s"]``) until other processes leave the CPUs
    alone for one second; returns the share seen in the last second."""
    start = time.perf_counter()
    while True:
        monitor = CpuMonitor()
        time.sleep(1.0)
        share = monitor.total()
        waited = time.perf_counter() - start
        if share <= QUIET / 2 or waited >= budget["wait_s"]:
            budget["wait_s"] = max(0.0, budget["wait_s"] - waited)
            if waited > 1.5:
                log(f"  waited {waited:.0f} s for other processes to quiet down (now {100 * share:.0f}%)")
            return share


@dataclass
class Steps:
    """Wall times of steps, each with the CPU share other processes used during it."""

    seconds: list[float] = field(default_factory=list)
    others: list[float] = field(default_factory=list)

    def add(self, seconds: float, others: float) -> None:
        self.seconds.append(seconds)
        self.others.append(others)

    def chosen(self) -> list[float]:
        """The quiet steps when there are at least 3 and at least a third of all; else all."""
        quiet = [s for s, o in zip(self.seconds, self.others) if o <= QUIET]
        return quiet if len(quiet) >= max(3, len(self.seconds) / 3) else self.seconds

    def median(self) -> float:
        return statistics.median(self.chosen())

    def summary(self) -> dict:
        quiet = sum(o <= QUIET for o in self.others)
        return {
            "median_ms": 1e3 * self.median(),
            "steps": len(self.seconds),
            "quiet_steps": quiet,
            "used_quiet_only": len(self.chosen()) < len(self.seconds),
            "seconds": self.seconds,
            "others_cpu_share": self.others,
        }


# -- memory bandwidth -----------------------------------------------------------------------------


def measure_bandwidth(mib: int, repeats: int) -> dict:
    """Read bandwidth (``sum`` over a ``mib`` MiB float32 tensor) and copy bandwidth (read +
    write bytes of a ``mib`` MiB copy), medians of ``repeats``, in GB/s (10^9 bytes)."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    src.sum()
    dst.copy_(src)  # touch every page first
    monitor = CpuMonitor()
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
        "read_gb_s": nbytes / statistics.median(read) / 1e9,
        "copy_gb_s": 2 * nbytes / statistics.median(copy) / 1e9,
        "others_cpu_share": monitor.total(),
    }


# -- engine runs ----------------------------------------------------------------------------------


@dataclass
class EngineRun:
    """One engine with a batch of requests admitted and prefilled, stepped one decode at a time."""

    name: str
    engine: Engine
    prefill_s: float
    steps: dict[str, Steps] = field(default_factory=dict)
    extra: dict[str, list[float]] = field(default_factory=dict)
    """Per backend: each step's time minus that of the no-adapter twin's step just before it."""
    round_bandwidth: list[float] = field(default_factory=list)
    """Read bandwidth (GB/s) measured right before this engine's steps of each recorded round."""
    monitor: CpuMonitor = field(default_factory=CpuMonitor)

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
        sink=None,
    ) -> EngineRun:
        engine = local_engine(
            model,
            EngineConfig(pool_mib=pool_mib, max_running=len(prompts)),
            eos_token_ids=loaded.config.eos_token_ids,
        )
        for adapter in adapters:
            engine.add_adapter(adapter)
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            adapter_id = adapters[i % len(adapters)].adapter_id if adapters else None
            request = GenerationRequest(f"{name}-{i}", prompt, sampling, adapter_id)
            engine.submit(request, sink or (lambda event: None))
        t = time.perf_counter()
        produced = engine.step()
        prefill_s = time.perf_counter() - t
        if produced != len(prompts) or len(engine.running) != len(prompts):
            raise RuntimeError(f"{name}: the prefill step admitted {len(engine.running)} of {len(prompts)}")
        return cls(name, engine, prefill_s)

    def step(self, backend: str, record: bool = True) -> float:
        """One decode step of the whole batch with ``backend``; returns its wall time."""
        self.engine.lora_backend = backend
        batch = len(self.engine.running)
        self.monitor.tick()
        t = time.perf_counter()
        produced = self.engine.step()
        elapsed = time.perf_counter() - t
        others = self.monitor.tick()
        if produced != batch:
            raise RuntimeError(f"{self.name}: a decode step produced {produced} tokens for {batch} requests")
        if record:
            self.steps.setdefault(backend, Steps()).add(elapsed, others)
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


# -- 1. base decode: engine vs HF generate --------------------------------------------------------


def hf_model(loaded: LoadedModel, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**loaded.config.to_hf_config()))
    model.load_state_dict(loaded.weights, strict=False)
    model.tie_weights()
    return model.to(dtype).eval()


def hf_generate(model, input_ids: torch.Tensor, new_tokens: int, pad_id: int, steps: Steps | None = None):
    """Time ``generate``; with ``steps``, also every decode step (a stopping criterion that only
    reads the clock runs after the prefill and after each decode step)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    monitor = CpuMonitor()
    marks: list[tuple[float, float]] = []

    class Clock(StoppingCriteria):
        def __call__(self, ids, scores, **kwargs):
            marks.append((time.perf_counter(), monitor.tick()))
            return torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)

    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            stopping_criteria=StoppingCriteriaList([Clock()]) if steps is not None else None,
        )
    elapsed = time.perf_counter() - t
    if out.shape[1] != input_ids.shape[1] + new_tokens:
        raise RuntimeError(f"HF generate made {out.shape[1] - input_ids.shape[1]} tokens, not {new_tokens}")
    if steps is not None:
        for (before, _), (after, others) in itertools.pairwise(marks):
            steps.add(after - before, others)
    return elapsed, out[:, input_ids.shape[1] :], monitor.total()


def base_decode(loaded, model, dtype, prompts, new_tokens: int, repeats: int, budget: dict, log) -> dict:
    batch = len(prompts)
    decode_tokens = batch * (new_tokens - 1)  # each request's first token comes from the prefill
    hf = hf_model(loaded, dtype)
    input_ids = torch.tensor(prompts, dtype=torch.int64)
    pad_id = loaded.config.eos_token_ids[0] if loaded.config.eos_token_ids else 0
    hf_generate(hf, input_ids[:4, :8], 2, pad_id)  # warm-up
    engine_runs, hf_runs = [], []
    engine_steps, hf_steps = Steps(), Steps()
    first_token_agreement = None
    for r in range(repeats):
        gc.collect()
        wait_quiet(budget, log)
        outputs: dict[str, list[int]] = {}
        run = EngineRun.start(
            "base",
            model,
            loaded,
            prompts,
            new_tokens,
            [],
            256,
            lambda event, outputs=outputs: outputs.setdefault(event.request_id, []).append(event.token_id),
        )
        monitor = CpuMonitor()
        while run.engine.has_work():
            run.step(NO_ADAPTER)
        steps = run.steps[NO_ADAPTER]
        if len(steps.seconds) != new_tokens - 1:
            raise RuntimeError(f"engine ran {len(steps.seconds)} decode steps, expected {new_tokens - 1}")
        engine_steps.seconds += steps.seconds
        engine_steps.others += steps.others
        decode_s = sum(steps.seconds)
        engine_runs.append(
            {
                "prefill_s": run.prefill_s,
                "decode_s": decode_s,
                "decode_tok_s": decode_tokens / decode_s,
                "others_cpu_share": monitor.total(),
            }
        )
        log(
            f"  engine run {r + 1}: prefill {run.prefill_s:.1f} s, decode {decode_s:.1f} s, "
            f"{decode_tokens / decode_s:.0f} tok/s, others' CPU {100 * engine_runs[-1]['others_cpu_share']:.0f}%"
        )
        del run
        gc.collect()
        wait_quiet(budget, log)
        full_s, hf_tokens, others_full = hf_generate(hf, input_ids, new_tokens, pad_id, hf_steps)
        prefill_s, _, others_prefill = hf_generate(hf, input_ids, 1, pad_id)
        hf_runs.append(
            {
                "generate_s": full_s,
                "generate_1_s": prefill_s,
                "decode_s": full_s - prefill_s,
                "decode_tok_s": decode_tokens / (full_s - prefill_s),
                "others_cpu_share": max(others_full, others_prefill),
            }
        )
        log(
            f"  HF run {r + 1}: generate({new_tokens}) {full_s:.1f} s, generate(1) {prefill_s:.1f} s, "
            f"{decode_tokens / (full_s - prefill_s):.0f} tok/s, "
            f"others' CPU {100 * hf_runs[-1]['others_cpu_share']:.0f}%"
        )
        if first_token_agreement is None:
            # Sanity: both greedy-decode the same model (bf16 rounding may split near-ties).
            ours = [outputs[f"base-{i}"][0] for i in range(batch)]
            first_token_agreement = sum(int(a == b) for a, b in zip(ours, hf_tokens[:, 0].tolist())) / batch
    engine_tok_s = statistics.median([run["decode_tok_s"] for run in engine_runs])
    hf_tok_s = statistics.median([run["decode_tok_s"] for run in hf_runs])
    return {
        "batch": batch,
        "prompt_len": len(prompts[0]),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "engine_decode_tok_s": engine_tok_s,
        "hf_decode_tok_s": hf_tok_s,
        "ratio": engine_tok_s / hf_tok_s,
        "engine_step": engine_steps.summary(),
        "hf_step": hf_steps.summary(),
        "step_ratio": hf_steps.median() / engine_steps.median(),
        "first_token_agreement": first_token_agreement,
        "engine_runs": engine_runs,
        "hf_runs": hf_runs,
    }


# -- 2 and 3. adapters ----------------------------------------------------------------------------


def make_adapters(count: int, dtype: torch.dtype, root: Path) -> list[HostAdapter]:
    spec = load_base_model_spec()
    dtype_name = str(dtype).removeprefix("torch.")
    adapters = []
    for i in range(count):
        rank = RANKS[i % len(RANKS)]
        sample = SampleAdapterSpec(rank=rank, target_modules=LORA_TARGETS, dtype=dtype_name, seed=100 + i)
        files = adapter_files(write_peft_adapter(root / f"a{i}", spec, sample))
        config, weights = files["adapter_config.json"], files["adapter_model.safetensors"]
        adapters.append(parse_peft_adapter(f"a{i}-r{rank}", config, weights, dtype))
    return adapters


def twin(name: str) -> str:
    """Name of the no-adapter engine stepped right before engine ``name`` (same context length)."""
    return f"{name}-base"


def adapter_rounds(
    loaded, model, prompts, adapters, ks: list[int], warmup: int, rounds: int, budget: dict, log
) -> dict[str, EngineRun]:
    """One engine per k with adapters, each with a twin without adapters. Every adapter step is
    taken right after a step of its twin, so each extra time is a difference of two steps a
    fraction of a second apart at the same context length: this host drifts between a fast and
    a slow regime (the same no-adapter step 130 vs 200 ms) on a scale of tens of seconds, and
    medians of separately taken steps mixed the regimes (a k = 8 extra of 73 ms when the paired
    steps differ by 18 ms)."""
    # Never finished while measured: one step per backend per round, then one per profile.
    max_tokens = len(BACKENDS) * (warmup + rounds) + len(BACKENDS) + 4
    kv_mib = 128  # 32 requests x ~100 tokens x 30 layers x K+V of 192 bf16 values is ~70 MB
    runs: dict[str, EngineRun] = {}
    for k in ks:
        name, chosen = f"k{k}", adapters[:k]
        runs[twin(name)] = EngineRun.start(twin(name), model, loaded, prompts, max_tokens, [], kv_mib)
        mib = kv_mib + 1.3 * sum(a.nbytes for a in chosen) / 2**20
        runs[name] = EngineRun.start(name, model, loaded, prompts, max_tokens, chosen, mib)
        log(f"  prefilled {name} and its twin in {runs[name].prefill_s + runs[twin(name)].prefill_s:.1f} s")
    probe = torch.ones(ROUND_PROBE_MIB * 2**20 // 4)
    probe.sum()
    for r in range(warmup + rounds):
        record = r >= warmup
        if record:
            wait_quiet(budget, log)
        order = BACKENDS if r % 2 == 0 else BACKENDS[::-1]
        monitor = CpuMonitor()
        t = time.perf_counter()
        for k in ks:
            run, base = runs[f"k{k}"], runs[twin(f"k{k}")]
            if record:
                start = time.perf_counter()
                probe.sum()
                run.round_bandwidth.append(probe.numel() * 4 / (time.perf_counter() - start) / 1e9)
            for backend in order:
                base_s = base.step(NO_ADAPTER, record)
                step_s = run.step(backend, record)
                if record:
                    run.extra.setdefault(backend, []).append(step_s - base_s)
        log(
            f"  round {r + 1}/{warmup + rounds}{'' if record else ' (warm-up)'}: "
            f"{time.perf_counter() - t:.1f} s, other processes used {100 * monitor.total():.0f}% CPU"
        )
    return runs


def adapter_figures(runs: dict[str, EngineRun], adapters, ks, bandwidth_gb_s: float) -> tuple[list, list]:
    """Part 2 (every backend's extra step time against the bound) and part 3 (gather backends
    against padded bmm)."""
    overhead, backends = [], []
    for k in ks:
        run, base = runs[f"k{k}"], runs[twin(f"k{k}")]
        base_ms = 1e3 * base.steps[NO_ADAPTER].median()
        step_ms = {backend: 1e3 * run.steps[backend].median() for backend in BACKENDS}
        extra_ms = {backend: 1e3 * statistics.median(run.extra[backend]) for backend in BACKENDS}
        nbytes = sum(a.nbytes for a in adapters[:k])
        bound_ms = 1e3 * nbytes / (bandwidth_gb_s * 1e9)
        # The same ratio with each round's extra against a bound from that round's bandwidth.
        same_round = {
            backend: statistics.median(
                extra * gb_s * 1e9 / nbytes for extra, gb_s in zip(run.extra[backend], run.round_bandwidth)
            )
            for backend in BACKENDS
        }
        for backend in BACKENDS:
            overhead.append(
                {
                    "k": k,
                    "backend": backend,
                    "ranks": sorted({a.max_rank for a in adapters[:k]}),
                    "base_step_ms": base_ms,
                    "step_ms": step_ms[backend],
                    "extra_ms": extra_ms[backend],
                    "adapter_mb": nbytes / 1e6,
                    "bound_ms": bound_ms,
                    "extra_over_bound": extra_ms[backend] / bound_ms,
                    "round_bandwidth_gb_s": statistics.median(run.round_bandwidth),
                    "extra_over_same_round_bound": same_round[backend],
                }
            )
        backends.append(
            {
                "k": k,
                **{f"{backend}_step_ms": step_ms[backend] for backend in BACKENDS},
                **{f"{backend}_extra_ms": extra_ms[backend] for backend in BACKENDS},
                **{f"bmm_over_{backend}": step_ms["padded_bmm"] / step_ms[backend] for backend in GATHER},
            }
        )
    return overhead, backends


# -- profile --------------------------------------------------------------------------------------


def _is_base_matmul(shapes, base_dims: set[int]) -> bool:
    """An ``aten::mm`` whose second operand has only base-model dimensions (no LoRA rank)."""
    return len(shapes) >= 2 and len(shapes[1]) == 2 and all(d in base_dims for d in shapes[1])


def profile_step(run: EngineRun, backend: str) -> dict:
    """Profile one decode step and split its wall time by kind of work (self CPU time)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cfg = run.engine.executor.model.config
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    base_dims = {cfg.hidden_size, cfg.intermediate_size, 2 * cfg.intermediate_size, cfg.vocab_size}
    base_dims |= {q_dim, q_dim + 2 * kv_dim}
    run.engine.lora_backend = backend
    monitor = CpuMonitor()
    native = NativeCall.run

    def labelled_native(*args) -> None:
        # The C kernel is no aten op: a profiler range makes its time visible as LoRA work.
        with record_function(NATIVE_LABEL):
            native(*args)

    NativeCall.run = labelled_native
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            t = time.perf_counter()
            run.engine.step()
            wall = time.perf_counter() - t
    finally:
        NativeCall.run = native
    others = monitor.total()
    buckets = {"base_matmul": 0.0, "lora_matmul": 0.0, "attention": 0.0, "other_ops": 0.0}
    calls = 0
    for event in prof.events():
        self_s = event.self_cpu_time_total / 1e6
        if event.name == NATIVE_LABEL:
            buckets["lora_matmul"] += self_s
            continue
        if not event.name.startswith("aten::"):
            continue
        calls += 1
        if event.name in ("aten::mm", "aten::addmm"):
            base = _is_base_matmul(event.input_shapes, base_dims)
            buckets["base_matmul" if base else "lora_matmul"] += self_s
        elif event.name == "aten::bmm":
            buckets["lora_matmul"] += self_s
        elif "scaled_dot_product" in event.name:
            buckets["attention"] += self_s
        else:
            buckets["other_ops"] += self_s
    buckets["python_and_framework"] = max(0.0, wall - sum(buckets.values()))
    return {
        "backend": backend,
        "wall_ms": 1e3 * wall,
        "aten_calls": calls,
        "others_cpu_share": others,
        "ms": {name: 1e3 * s for name, s in buckets.items()},
        "share": {name: s / wall for name, s in buckets.items()},
        "top_ops": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12),
    }


# -- report ---------------------------------------------------------------------------------------


def _steps_note(summary: dict) -> str:
    return f"{summary['quiet_steps']}/{summary['steps']} quiet"


def markdown(result: dict) -> str:
    base, bw, m = result["base_decode"], result["bandwidth"], result["machine"]
    engine_others = max(r["others_cpu_share"] for r in base["engine_runs"])
    hf_others = max(r["others_cpu_share"] for r in base["hf_runs"])
    lines = [
        (
            f"Machine: {m['cpu']}, {m['logical_cpus']} CPUs, avx512_bf16={m.get('avx512_bf16')}, "
            f"torch {m['torch']} ({m['torch_cpu_capability']}), {result['threads']} threads, "
            f"weights/KV/adapters in {result['dtype']}, engine computes in {result['compute_dtype']} "
            f"(HF in {result['dtype']}); run took {result['elapsed_s'] / 60:.1f} min"
        ),
        (
            f"Memory bandwidth: read {bw['read_gb_s']:.1f} GB/s (sum of {bw['tensor_mib']} MiB), "
            f"copy {bw['copy_gb_s']:.1f} GB/s (read + write); the bound uses the read figure"
        ),
        (
            "CPU used by other processes while measuring (share of all CPUs, worst run): "
            f"bandwidth {100 * bw['others_cpu_share']:.0f}%, engine runs {100 * engine_others:.0f}%, "
            f"HF runs {100 * hf_others:.0f}%; step medians use the steps under {100 * QUIET:.0f}% "
            "when there are enough (counts below)"
        ),
        "",
        (
            f"**1. Base decode, batch {base['batch']}, prompt {base['prompt_len']}, "
            f"{base['new_tokens']} new tokens, no adapters** ({base['repeats']} runs each)"
        ),
        "",
        "| | decode tok/s (total decode time) | median decode step ms | steps |",
        "|---|---|---|---|",
        (
            f"| engine | {base['engine_decode_tok_s']:.0f} | {base['engine_step']['median_ms']:.0f} | "
            f"{_steps_note(base['engine_step'])} |"
        ),
        (
            f"| HF generate | {base['hf_decode_tok_s']:.0f} | {base['hf_step']['median_ms']:.0f} | "
            f"{_steps_note(base['hf_step'])} |"
        ),
        (
            f"| **engine / HF** (target ≥ 1.3×) | **{base['ratio']:.2f}×** | "
            f"{base['step_ratio']:.2f}× (by median step) | |"
        ),
        "",
        f"First generated token equal to HF's for {100 * base['first_token_agreement']:.0f}% of requests.",
        "",
        (
            f"**2. Adapter overhead, batch {base['batch']} decode, per LoRA backend** "
            f"({result['rounds']} interleaved steps per figure; `{BACKENDS[0]}` is the engine's default)"
        ),
        "",
        (
            "| k adapters | backend | step ms | no-adapter step ms | extra ms (median of paired steps) "
            "| adapter MB | bound ms | extra / bound | extra / bound of the same round (GB/s) |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["adapter_overhead"]:
        target = " (target ≤ 2)" if row["k"] >= 8 and row["backend"] == BACKENDS[0] else ""
        lines.append(
            f"| {row['k']} | {row['backend']} | {row['step_ms']:.0f} | {row['base_step_ms']:.0f} | "
            f"{row['extra_ms']:.1f} | {row['adapter_mb']:.1f} | {row['bound_ms']:.2f} | "
            f"{row['extra_over_bound']:.2f}{target} | {row['extra_over_same_round_bound']:.2f} "
            f"({row['round_bandwidth_gb_s']:.1f}) |"
        )
    lines += [
        "",
        "**3. Gather backends vs padded bmm, same mixed-rank batch** (step ms; extra ms in brackets)",
        "",
        "| k adapters | " + " | ".join(BACKENDS) + " | " + " | ".join(f"bmm / {b}" for b in GATHER) + " |",
        "|---|" + "---|" * (len(BACKENDS) + len(GATHER)),
    ]
    for row in result["backends"]:
        steps = " | ".join(f"{row[f'{b}_step_ms']:.0f} ({row[f'{b}_extra_ms']:.1f})" for b in BACKENDS)
        ratios = " | ".join(f"{row[f'bmm_over_{b}']:.2f}" for b in GATHER)
        lines.append(f"| {row['k']} | {steps} | {ratios} |")
    quiet = ", ".join(
        f"{name}/{backend} {_steps_note(summary)}"
        for name, per_backend in result["adapter_steps"].items()
        for backend, summary in per_backend.items()
    )
    lines += ["", f"Steps: {quiet}."]
    if result.get("profiles"):
        lines += [
            "",
            (
                "**Profile of one decode step** (torch.profiler, self CPU time; the profiler's own "
                "per-call cost inflates steps with many calls)"
            ),
            "",
            "| step | wall ms | aten calls | base matmul | LoRA matmul | attention | other ops | Python etc. |",
            "|---|---|---|---|---|---|---|---|",
        ]
        keys = ("base_matmul", "lora_matmul", "attention", "other_ops", "python_and_framework")
        for name, prof in result["profiles"].items():
            cells = " | ".join(f"{prof['ms'][key]:.0f} ({100 * prof['share'][key]:.0f}%)" for key in keys)
            lines.append(f"| {name} | {prof['wall_ms']:.0f} | {prof['aten_calls']} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="shorter prompts, fewer tokens/rounds (~1.5 min)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=None, help="default 32; quick 16")
    parser.add_argument("--new-tokens", type=int, default=None, help="part 1 (default 64; quick 16)")
    parser.add_argument("--repeats", type=int, default=None, help="part 1 runs (default 2; quick 1)")
    parser.add_argument("--rounds", type=int, default=None, help="parts 2-3 rounds (default 12; quick 3)")
    parser.add_argument("--ks", default="1,8,32", help="numbers of distinct adapters")
    parser.add_argument("--max-wait", type=float, default=None, help="total s to wait for a quiet CPU")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    prompt_len = args.prompt_len or (16 if args.quick else 32)
    new_tokens = args.new_tokens or (16 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 2)
    rounds = args.rounds or (3 if args.quick else 12)
    warmup = 1 if args.quick else 2
    ks = [int(k) for k in args.ks.split(",")]
    budget = {"wait_s": args.max_wait if args.max_wait is not None else (20.0 if args.quick else 120.0)}
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {message}", flush=True)

    result: dict = {
        "command": " ".join(["bench/worker_bench.py", *(argv if argv is not None else sys.argv[1:])]),
        "dtype": args.dtype,
        "threads": args.threads,
        "machine": machine(),
    }
    log(f"machine: {result['machine']}")
    for _ in range(4):  # a contended measurement would understate bandwidth, inflating the bound
        wait_quiet(budget, log)
        bandwidth = measure_bandwidth(1024, 5)
        if "bandwidth" not in result or bandwidth["read_gb_s"] > result["bandwidth"]["read_gb_s"]:
            result["bandwidth"] = bandwidth
        if bandwidth["others_cpu_share"] <= QUIET:
            break
    log(f"bandwidth: {result['bandwidth']}")

    loaded = load_model()
    model = LlamaModel(loaded.config, loaded.weights, dtype)
    result["compute_dtype"] = str(model.compute_dtype).removeprefix("torch.")
    log(f"model stored in {args.dtype}, computing in {result['compute_dtype']}")
    prompts = make_prompts(loaded, args.batch, prompt_len)

    log(f"1. base decode: engine vs HF generate, {new_tokens} new tokens, {repeats} run(s)")
    result["base_decode"] = base_decode(loaded, model, dtype, prompts, new_tokens, repeats, budget, log)

    log(f"2-3. adapters: writing {max(ks)} adapters")
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(max(ks), dtype, Path(tmp))
    gc.collect()
    runs = adapter_rounds(loaded, model, prompts, adapters, ks, warmup, rounds, budget, log)
    result["rounds"] = rounds
    result["warmup_rounds"] = warmup
    overhead, backends = adapter_figures(runs, adapters, ks, result["bandwidth"]["read_gb_s"])
    result["adapter_overhead"] = overhead
    result["backends"] = backends
    result["prefill_s"] = {name: run.prefill_s for name, run in runs.items()}
    result["adapter_steps"] = {
        name: {backend: steps.summary() for backend, steps in run.steps.items()} for name, run in runs.items()
    }

    if not args.no_profile:
        log("profiling decode steps")
        biggest = f"k{max(ks)}"
        targets = [
            ("no adapter", twin(biggest), NO_ADAPTER),
            (f"{biggest} cpu_native", biggest, "cpu_native"),
        ]
        if not args.quick:
            targets += [
                (f"{biggest} torch", biggest, "torch"),
                (f"{biggest} padded bmm", biggest, "padded_bmm"),
            ]
        result["profiles"] = {}
        for label, name, backend in targets:
            wait_quiet(budget, log)
            result["profiles"][label] = profile_step(runs[name], backend)
    result["elapsed_s"] = time.perf_counter() - started

    table = markdown(result)
    print()
    print(table)
    for name, prof in result.get("profiles", {}).items():
        print(f"\n{name}:\n{prof['top_ops']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result["markdown"] = table
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
