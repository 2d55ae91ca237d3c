"""Part 3, engine speed, bf16: decode without adapters against HF ``generate``, and the extra
step time of adapters against the bandwidth bound (adapter bytes / copy bandwidth)."""

from __future__ import annotations

import gc
import statistics
import time

import torch

from bench.gpu_checklist.context import Ctx
from bench.gpu_checklist.helpers import (
    RANKS,
    engine_model,
    hf_model,
    kv_mib,
    make_engine,
    random_prompts,
    template_adapters,
)
from services.gpu_worker.engine.engine import Engine
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.lora.host_adapter import HostAdapter
from services.model_files.peft_format import LORA_TARGETS


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
    engine = make_engine(ctx, model, kv_mib(ctx, batch, plen + new_tokens, dtype), batch, batch * plen)
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


def _base_decode(ctx: Ctx, model, hf, plen: int, new: int, dtype) -> list[dict]:
    """Decode tokens/s without adapters, engine against HF, per batch size."""
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
    return base


def _paired_steps(ctx: Ctx, twin: Engine, run: Engine, batch: int, warmup: int, rounds: int):
    """Decode steps of the twin (no adapters) and the adapter engine, alternating which goes
    first: (twin ms, adapter ms, adapter - twin ms) per measured round."""
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
    return twin_ms, run_ms, diffs


def _adapter_overhead(ctx: Ctx, model, plen: int, dtype, bw: dict) -> list[dict]:
    """The extra decode step time of k adapters against the bandwidth bound, per k."""
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
        kv = kv_mib(ctx, batch, plen + warmup + rounds + 8, dtype)
        twin = make_engine(ctx, model, kv, batch, batch * plen)
        run = make_engine(ctx, model, kv + 1.3 * nbytes / 2**20 + 16, batch, batch * plen)
        for a in adapters:
            run.add_adapter(a)
        for i, p in enumerate(prompts):
            twin.submit(GenerationRequest(f"t{i}", p, sampling), lambda e: None)
            run.submit(GenerationRequest(f"a{i}", p, sampling, adapters[i % k].adapter_id), lambda e: None)
        twin.step()
        run.step()  # prefill (pages the adapters in)
        twin_ms, run_ms, diffs = _paired_steps(ctx, twin, run, batch, warmup, rounds)
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
    return extra


def part3(ctx: Ctx) -> dict:
    dtype = torch.bfloat16
    bw = ctx.copy_bandwidth()
    model = engine_model(ctx, dtype)
    hf = hf_model(ctx, dtype)
    plen, new = (8, 4) if ctx.quick else (32, 32)
    base = _base_decode(ctx, model, hf, plen, new, dtype)
    del hf
    gc.collect()
    extra = _adapter_overhead(ctx, model, plen, dtype, bw)
    return {"dtype": "bfloat16", "copy_bandwidth": bw, "base_decode": base, "adapter_overhead": extra}
