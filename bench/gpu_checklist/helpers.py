"""What the checklist's parts share: the model as HF and as the engine's, random prompts, sample
adapters, engines sized for a batch, running or timing their steps, and recording a step that
may fail."""

from __future__ import annotations

import random
import statistics
import time
import traceback
from pathlib import Path

import torch

from bench.gpu_checklist.context import Ctx
from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.lora.host_adapter import HostAdapter, parse_peft_adapter
from services.gpu_worker.model.llama import LlamaModel

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
RANKS = (8, 16, 32, 64)


def recorded(ctx: Ctx, label: str, fn, *args) -> dict:
    """``fn(*args)``'s result, or ``{"error": its traceback}`` (logged) when it raises, with the
    ``seconds`` it took added: a failure is recorded and the caller's other steps still run."""
    t = time.perf_counter()
    try:
        result = fn(*args)
    except Exception:  # noqa: BLE001 (recorded; the other parts still run)
        result = {"error": traceback.format_exc()}
        ctx.log(f"{label} FAILED:\n{result['error']}")
    result["seconds"] = time.perf_counter() - t
    return result


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


def make_engine(ctx: Ctx, model: LlamaModel, pool_mib: float, max_running: int, max_prefill: int) -> Engine:
    """An engine on ``model`` with the model's EOS tokens and these sizes."""
    config = ctx.model()["config"]
    return local_engine(
        model,
        EngineConfig(pool_mib=pool_mib, max_running=max_running, max_prefill_tokens=max_prefill),
        eos_token_ids=config.eos_token_ids,
    )


def kv_mib(ctx: Ctx, batch: int, context: int, dtype: torch.dtype) -> float:
    """A pool size (MiB) that holds the KV cache of ``batch`` requests of ``context`` tokens."""
    c = ctx.model()["config"]
    per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * torch.finfo(dtype).bits // 8
    return 1.5 * batch * (context + 32) * per_token / 2**20 + 16


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


def median(values) -> float | None:
    """The median, or None of nothing."""
    values = list(values)
    return statistics.median(values) if values else None


def fmt_ms(v) -> str:
    """Milliseconds as the report writes them (``-`` for none)."""
    return "-" if v is None else f"{v:.2f}"
