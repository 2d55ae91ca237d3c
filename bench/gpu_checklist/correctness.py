"""Part 1, correctness: the LoRA kernels against the torch reference computed in fp32, and the
engine against HF transformers + peft on the same weights, teacher-forced with its tokens."""

from __future__ import annotations

import gc

import torch

from bench.gpu_checklist.context import Ctx
from bench.gpu_checklist.helpers import engine_model, hf_model, random_prompts, recorded, run_engine
from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.kernels.lora_segments import AdapterRows, LoraSegments
from services.gpu_worker.kernels.padded_bmm import lora_delta_padded_bmm
from services.gpu_worker.kernels.torch_reference import lora_delta_torch
from services.model_files.peft_format import LORA_TARGETS

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
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


def _engine_tokens_and_logits(ctx: Ctx, dtype: torch.dtype, dirs: dict, prompts, new_tokens: int):
    """The engine's greedy tokens and each step's logits for ENGINE_REQUESTS, and its compute dtype."""
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
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    requests = [
        GenerationRequest(f"r{i}", prompts[i], sampling, adapter)
        for i, (adapter, _) in enumerate(ENGINE_REQUESTS)
    ]
    tokens, _, _ = run_engine(engine, requests)
    return tokens, logits, compute_dtype


def _peft_model(ctx: Ctx, dtype: torch.dtype, dirs: dict):
    """HF transformers + peft with every adapter of ``dirs`` loaded."""
    from peft import PeftModel

    base = hf_model(ctx, dtype)
    names = list(dirs)
    model = PeftModel.from_pretrained(base, str(dirs[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(dirs[name]), adapter_name=name)
    return model.to(device=ctx.device, dtype=dtype).eval()


def _compare(rid: str, adapter, prompt, forced: list[int], ours: list, theirs: list) -> dict:
    """One request's engine logits (``ours``) against HF's (``theirs``), step by step."""
    diffs, first_flip = [], None
    for step, (mine, hf) in enumerate(zip(ours, theirs)):
        diffs.append((mine - hf).abs().max().item())
        if first_flip is None and int(hf.argmax()) != forced[step]:
            top2 = hf.topk(2).values
            first_flip = {
                "step": step,
                "engine_token": forced[step],
                "hf_token": int(hf.argmax()),
                "hf_top2_gap": (top2[0] - top2[1]).item(),
                "hf_logit_gap_to_engine_token": (hf.max() - hf[forced[step]]).item(),
                "logit_diff_at_flip": diffs[-1],
            }
    return {
        "request": rid,
        "adapter": adapter,
        "prompt_len": len(prompt),
        "steps": len(theirs),
        "engine_tokens": len(forced),
        "max_logit_diff": max(diffs),
        "max_logit_diff_before_flip": max(diffs[: first_flip["step"]] or [0.0]) if first_flip else max(diffs),
        "first_flip": first_flip,
    }


def part1_engine(ctx: Ctx, dtype: torch.dtype, new_tokens: int) -> dict:
    spec = ctx.model()["spec"]
    dirs = {
        name: write_peft_adapter(ctx.tmp / f"eng-{name}", spec, sample)
        for name, sample in ENGINE_ADAPTERS.items()
    }
    prompts = random_prompts(ctx, [n for _, n in ENGINE_REQUESTS], seed=1)
    tokens, logits, compute_dtype = _engine_tokens_and_logits(ctx, dtype, dirs, prompts, new_tokens)
    model = _peft_model(ctx, dtype, dirs)
    per_request = []
    for i, (adapter, _) in enumerate(ENGINE_REQUESTS):
        rid = f"r{i}"
        forced = tokens[rid]
        with torch.no_grad():
            if adapter is None:
                with model.disable_adapter():
                    steps = _teacher_forced(model, prompts[i], forced, ctx.device)
            else:
                model.set_adapter(adapter)
                steps = _teacher_forced(model, prompts[i], forced, ctx.device)
        per_request.append(_compare(rid, adapter, prompts[i], forced, logits[rid], steps))
    del model
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
        result[name] = recorded(ctx, f"part 1 {name}", fn)
        ctx.log(f"part 1 {name}: {result[name]['seconds']:.1f} s")
        gc.collect()
    return result
