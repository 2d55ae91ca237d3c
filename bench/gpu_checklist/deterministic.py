"""Part 5 (c), deterministic (batch-invariant) serving, bf16: probe requests' greedy tokens alone
against inside a batch of mixed-adapter requests, in deterministic mode (or its refusal on this
device) and in the default mode, and both modes' step times."""

from __future__ import annotations

import gc
import random
import traceback

import torch

from bench.gpu_checklist.context import Ctx
from bench.gpu_checklist.helpers import (
    RANKS,
    engine_model,
    kv_mib,
    median,
    random_prompts,
    template_adapters,
    timed_steps,
)
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.model_files.peft_format import LORA_TARGETS


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
    kv = kv_mib(ctx, batch, 48 + new, dtype)
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
                "prefill_ms": steps[0][1], "decode_step_ms": median(ms for n, ms in steps[1:] if n == batch),
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
