"""Part 4, serving, bf16: the engine in-process on a synthetic trace over n = 100 and n = 2,000
adapters (the quick profile of ``loramesh bench``), against the PEFT baseline (HF + peft, one
adapter at a time) on the first adapters of the first trace."""

from __future__ import annotations

import gc
import random
import time

import torch

from bench.gpu_checklist.context import Ctx
from bench.gpu_checklist.helpers import (
    ATTN,
    engine_model,
    hf_model,
    kv_mib,
    make_engine,
    random_prompts,
    run_engine,
    template_adapters,
)
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.lora.host_adapter import HostAdapter, with_rows


def _engine_runs(
    ctx: Ctx, templates: dict, prompts, sampling, ns, max_running: int, dtype
) -> tuple[list, dict]:
    """The engine's throughput on each n's trace: (one row per n, each n's trace of adapters)."""
    plen, new, n_req = len(prompts[0]), sampling.max_tokens, len(prompts)
    model = engine_model(ctx, dtype)
    # Warm-up (kernels compiled, allocator primed).
    warm = make_engine(ctx, model, 256, 4, 4 * plen)
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
        kv = kv_mib(ctx, max_running, plen + new, dtype)
        engine = make_engine(ctx, model, kv + 1.3 * adapter_mib + 64, max_running, 4096)
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
    return engine_runs, traces


def _peft_baseline(ctx: Ctx, templates: dict, trace: list[int], prompts, new: int, adapters: int, dtype):
    """HF + peft on the first ``adapters`` adapters of ``trace``, in first-arrival order, one at a
    time: (adapters run, one row per adapter, tokens, seconds)."""
    from peft import PeftModel

    order = list(dict.fromkeys(trace))[:adapters]
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
    del peft, base
    gc.collect()
    return order, batches, total_tokens, peft_s


def part4(ctx: Ctx) -> dict:
    dtype = torch.bfloat16
    n_req, plen, new = (8, 8, 4) if ctx.quick else (256, 32, 32)
    ns = (4, 20) if ctx.quick else tuple(int(n) for n in ctx.args.serving_ns.split(","))
    max_running = 8 if ctx.quick else 128
    peft_adapters = 2 if ctx.quick else 10
    templates = template_adapters(ctx, (8, 16), ATTN, dtype, "serve")
    prompts = random_prompts(ctx, [plen] * n_req, seed=5)
    sampling = SamplingParams(max_tokens=new, ignore_eos=True)
    engine_runs, traces = _engine_runs(ctx, templates, prompts, sampling, ns, max_running, dtype)
    # PEFT baseline: the first `peft_adapters` adapters of the n = ns[0] trace, in first-arrival order.
    order, batches, total_tokens, peft_s = _peft_baseline(
        ctx, templates, traces[ns[0]], prompts, new, peft_adapters, dtype
    )
    peft_tok_s = total_tokens / peft_s
    covered = sum(b["requests"] for b in batches)
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
