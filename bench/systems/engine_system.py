"""loramesh's engine in-process (system b) and its ablations (e: padded bmm, f: split pool).

The request path is the worker's own without gRPC: each arriving request takes a reference on
its adapter through the worker's :class:`AdapterLoader` (read from the adapter directory on disk
when its host copy is not in RAM, within the host RAM budget), is submitted to the engine running
on its own thread, and gives the reference back when it ends. Page-ins, LRU eviction and
preemption are the engine's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from bench.systems.base import RequestRecord, RunContext
from services.gpu_worker.adapter_loader import AdapterLoader
from services.gpu_worker.adapter_source import DirectorySource
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import FinishReason, GenerationRequest, TokenEvent
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.gpu_worker.service import resolve_dtype

SAMPLE_PERIOD_S = 0.25
"""How often the pool occupancy is sampled."""


@dataclass(frozen=True)
class EngineSystemOptions:
    """Which variant of the engine to run."""

    name: str = "loramesh"
    """Label in tables and plots."""
    lora_backend: str = "auto"
    """LoRA kernels: ``auto`` (the gather kernels) or ``padded_bmm`` for ablation (e)."""
    adapter_region_share: float | None = None
    """None: the unified pool. A share of the pool reserved for adapters, the rest for KV:
    ablation (f), S-LoRA's "no unified memory"."""
    dtype: str = "auto"
    """Model dtype, as the worker's ``--dtype``."""


class EngineSystem:
    def __init__(self, options: EngineSystemOptions = EngineSystemOptions()):
        self.options = options
        self.name = options.name
        self.adapter_fetches = 0
        """Adapters read from disk during the last run (re-reads after a drop included)."""

    def stats(self) -> dict:
        """What the last run did besides serving, for the results file."""
        return {"adapter_fetches": self.adapter_fetches}

    def run(self, context: RunContext) -> list[RequestRecord]:
        loaded = load_model(context.model_path)
        dtype = resolve_dtype(self.options.dtype, torch.device("cpu"))
        model = LlamaModel(loaded.config, loaded.weights, dtype)
        engine = Engine(
            model,
            EngineConfig(
                pool_mib=context.pool_mib,
                max_running=context.max_batch,
                lora_backend=self.options.lora_backend,
                adapter_region_share=self.options.adapter_region_share,
            ),
            eos_token_ids=loaded.config.eos_token_ids,
        )
        loader = AdapterLoader(
            DirectorySource(context.adapters.root), engine, dtype, int(context.host_cache_mib * 2**20)
        )
        engine.start()
        try:
            records = asyncio.run(_replay(context, engine, loader))
        finally:
            engine.stop()
        self.adapter_fetches = loader.fetches
        return records


async def _replay(context: RunContext, engine: Engine, loader: AdapterLoader) -> list[RequestRecord]:
    records = [
        RequestRecord(r.request_id, r.adapter, r.time_s, r.input_len, r.output_len) for r in context.trace
    ]
    start = time.monotonic()
    deadline = start + context.window_s
    tasks = [
        asyncio.create_task(_serve(context, engine, loader, request, record, start, deadline))
        for request, record in zip(context.trace, records)
    ]
    sampler = asyncio.create_task(_sample_pool(context, engine, start))
    await asyncio.wait(tasks)
    sampler.cancel()
    return records


async def _serve(context, engine, loader, request, record: RequestRecord, start, deadline) -> None:
    await asyncio.sleep(max(0.0, start + request.time_s - time.monotonic()))
    try:
        await _generate(context, engine, loader, request, record, start, deadline)
    finally:
        context.on_progress(1)


async def _generate(context, engine, loader, request, record: RequestRecord, start, deadline) -> None:
    adapter_id = context.adapters.name(request.adapter)
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def on_event(event: TokenEvent) -> None:  # engine thread
        now = time.monotonic() - start
        if event.token_id is not None:
            record.output_tokens += 1
            if record.first_token_s is None:
                record.first_token_s = now
        if event.finish_reason is FinishReason.ERROR:
            record.error = event.error or "engine error"
        elif event.finish_reason is not None and record.output_tokens == record.output_len:
            record.finish_s = now
        if event.finish_reason is not None:
            loop.call_soon_threadsafe(done.set_result, None)

    try:
        await asyncio.wait_for(loader.acquire(adapter_id), timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        return
    try:
        engine.submit(
            GenerationRequest(
                request.request_id,
                context.prompt(request),
                SamplingParams(max_tokens=request.output_len, ignore_eos=True),
                adapter_id,
            ),
            on_event,
        )
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            engine.cancel(request.request_id)
            await done
    finally:
        loader.release(adapter_id)


async def _sample_pool(context: RunContext, engine: Engine, start: float) -> None:
    if context.on_sample is None:
        return
    while True:
        context.on_sample(time.monotonic() - start, engine.stats())
        await asyncio.sleep(SAMPLE_PERIOD_S)
