"""Part 5 (b), the prefix cache, fp32 and bf16: time to first token of requests whose long system
prompt (one per adapter) is cached, against a twin engine without the cache, alternating; a
control of prompts sharing nothing cached; greedy tokens of both compared."""

from __future__ import annotations

import gc
import time

import torch

from bench.gpu_checklist.context import Ctx
from bench.gpu_checklist.helpers import RANKS, engine_model, kv_mib, median, random_prompts, template_adapters
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.model_files.peft_format import LORA_TARGETS

SUFFIX_LEN = 12


def _engines(ctx: Ctx, model, adapters: list, pool_mib: float, prompt_len: int) -> dict[str, Engine]:
    """The twin engines, without and with the prefix cache, every adapter added to both."""
    engines = {}
    for name, cached in (("uncached", False), ("cached", True)):
        engines[name] = local_engine(
            model,
            EngineConfig(pool_mib=pool_mib, max_running=4,
                         max_prefill_tokens=max(2048, prompt_len), prefix_cache=cached),
            eos_token_ids=ctx.model()["config"].eos_token_ids,
        )  # fmt: skip
        for a in adapters:
            if a is not None:
                engines[name].add_adapter(a)
    return engines


def _request(rid: str, adapter, system, suffixes, sampling: SamplingParams) -> GenerationRequest:
    """``system`` and the next of ``suffixes`` as the prompt, for ``adapter`` (None: the base)."""
    prompt = tuple(system) + next(suffixes)
    adapter_id = None if adapter is None else adapter.adapter_id
    return GenerationRequest(rid, prompt, sampling, adapter_id)


def _one(ctx: Ctx, engine: Engine, req: GenerationRequest) -> tuple[float, list[int]]:
    """One request alone: (time to its first token, s; its tokens)."""
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


def _ttft(ctx: Ctx, engines: dict, measured: list, misses: list) -> tuple[dict, int, int]:
    """Each request on both engines, alternating which goes first: (TTFT ms per kind of request
    and engine, requests whose tokens were identical on both, requests compared)."""
    order = list(engines)
    ttft = {"hit": {n: [] for n in engines}, "miss": {n: [] for n in engines}}
    same, compared = 0, 0
    for kind, reqs in (("hit", measured), ("miss", misses)):
        for req in reqs:
            toks = {}
            for name in order:
                seconds, toks[name] = _one(ctx, engines[name], req)
                ttft[kind][name].append(1e3 * seconds)
            order.reverse()
            compared += 1
            same += toks["cached"] == toks["uncached"]
    return ttft, same, compared


def _system_len_row(ctx: Ctx, model, adapters: list, system_len: int, dtype) -> dict:
    """One system prompt length: the cached engine against its uncached twin."""
    reps = 1 if ctx.quick else 3
    new = 4 if ctx.quick else 8
    sampling = SamplingParams(max_tokens=new, ignore_eos=True)
    adapter_bytes = sum(a.nbytes for a in adapters if a is not None)
    prompt_len = system_len + SUFFIX_LEN
    kv = kv_mib(ctx, 2 * len(adapters) + 2, prompt_len + new, dtype)
    engines = _engines(ctx, model, adapters, kv + 1.3 * adapter_bytes / 2**20 + 32, prompt_len)
    systems = random_prompts(ctx, [system_len] * len(adapters), seed=system_len)
    suffixes = iter(random_prompts(ctx, [SUFFIX_LEN] * len(adapters) * (reps + 2), seed=system_len + 1))
    for i, adapter in enumerate(adapters):  # warm-up: caches each system prompt on the cached engine
        warm = _request(f"w{i}", adapter, systems[i], suffixes, sampling)
        for engine in engines.values():
            _one(ctx, engine, warm)
    measured = [
        _request(f"q{i}-{k}", adapters[i], systems[i], suffixes, sampling)
        for k in range(reps) for i in range(len(adapters))
    ]  # fmt: skip
    misses = [
        _request(f"m{i}", adapters[i], random_prompts(ctx, [system_len], seed=10_000 + system_len + i)[0], suffixes, sampling)
        for i in range(len(adapters))
    ]  # fmt: skip
    ttft, same, compared = _ttft(ctx, engines, measured, misses)
    stats = engines["cached"].stats()
    med = {k: {n: median(v) for n, v in d.items()} for k, d in ttft.items()}
    return {
        "system_tokens": system_len, "prompt_tokens": prompt_len, "new_tokens": new,
        "requests": len(measured), "ttft_ms": ttft, "median_ttft_ms": med,
        "ttft_ratio_cached_over_uncached": med["hit"]["cached"] / med["hit"]["uncached"],
        "miss_ttft_ratio_cached_over_uncached": med["miss"]["cached"] / med["miss"]["uncached"],
        "tokens_identical": same == compared, "identical_requests": same, "compared_requests": compared,
        "hit_blocks": stats.prefix_cache_hit_blocks, "missed_blocks": stats.prefix_cache_missed_blocks,
        "cached_blocks": stats.prefix_cache_blocks,
    }  # fmt: skip


def part5_prefix_cache(ctx: Ctx) -> dict:
    """Time to first token of a request whose long prompt prefix (its adapter's system prompt)
    is cached, against the same request on a twin engine without the cache; greedy tokens of
    both compared; a control of prompts sharing nothing cached."""
    lengths = (64,) if ctx.quick else (512, 2048)
    out = {}
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = engine_model(ctx, dtype)
        templates = template_adapters(ctx, RANKS, LORA_TARGETS, dtype, f"prefix-{dtype_name}")
        adapters = [None, *(templates[r][1] for r in RANKS)]
        rows = []
        for system_len in lengths:
            row = _system_len_row(ctx, model, adapters, system_len, dtype)
            rows.append(row)
            med = row["median_ttft_ms"]
            ctx.log(
                f"part 5 prefix cache {dtype_name} {system_len}: TTFT {med['hit']['cached']:.2f} vs "
                f"{med['hit']['uncached']:.2f} ms, identical {row['identical_requests']}/{row['compared_requests']}"
            )
            gc.collect()
        out[dtype_name] = rows
        del model
        gc.collect()
    return {
        "adapters": ["base", *(f"r{r} all projections" for r in RANKS)], "rows": out,
        "pass_fp32_identical": all(r["tokens_identical"] for r in out["float32"]),
    }  # fmt: skip
