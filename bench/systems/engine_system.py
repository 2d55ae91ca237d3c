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
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.systems.base import RequestRecord, RunContext
from bench.systems.clock import time_left
from bench.workload import TraceRequest
from services.gpu_worker.adapter_loader import AdapterLoader
from services.gpu_worker.adapter_source import DirectorySource
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.policies.batch_policy import BatchPolicy
from services.gpu_worker.engine.request import FinishReason, GenerationRequest, TokenEvent
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.engine.side_threads import side_thread_pool
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.gpu_worker.service import resolve_dtype

SAMPLE_PERIOD_S = 0.25
"""How often the pool occupancy is sampled."""
IO_THREADS = 4
"""Threads of the replay's ``to_thread`` calls (adapter parsing), confined as the worker's are."""


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
    preemption_policy: str = "newest"
    """Which running request the engine preempts when the pool runs dry (``--preemption-policy``)."""
    batch_policy: Callable[[], BatchPolicy] | None = None
    """Builds a fresh, configured batch policy for each run (policies keep state); None: the
    engine's default (FCFS)."""


class EngineSystem:
    def __init__(self, options: EngineSystemOptions = EngineSystemOptions()):
        self.options = options
        self.name = options.name
        self.adapter_fetches = 0
        """Adapters read from disk during the last run (re-reads after a drop included)."""
        self.engine_stats: dict = {}
        """The engine's stats at the end of the last run (policy decisions included)."""
        self.page_ins: list[float] = []
        """Seconds each adapter page-in into the pool took during the last run."""
        self.fetch_s: list[float] = []
        """Seconds each adapter fetch (read from disk, parsed into a host copy) took in the last run."""

    def stats(self) -> dict:
        """What the last run did besides serving, for the results file."""
        return {
            "adapter_fetches": self.adapter_fetches,
            "adapter_page_ins": len(self.page_ins),
            "adapter_page_in_s": round(sum(self.page_ins), 4),
            "adapter_fetch_s": round(sum(self.fetch_s), 4),
            **_policy_stats(self.engine_stats),
        }

    def run(self, context: RunContext) -> list[RequestRecord]:
        loaded = load_model(context.model_path)
        dtype = resolve_dtype(self.options.dtype, torch.device("cpu"))
        model = LlamaModel(loaded.config, loaded.weights, dtype)
        engine = local_engine(
            model,
            EngineConfig(
                pool_mib=context.pool_mib,
                max_running=context.max_batch,
                lora_backend=self.options.lora_backend,
                adapter_region_share=self.options.adapter_region_share,
                preemption_policy=self.options.preemption_policy,
            ),
            eos_token_ids=loaded.config.eos_token_ids,
            batch_policy=self.options.batch_policy() if self.options.batch_policy else None,
        )
        self.page_ins = []
        engine.adapters.on_paged_in = self.page_ins.append  # engine thread; list.append is atomic
        loader = AdapterLoader(
            DirectorySource(context.adapters.root), engine, dtype, int(context.host_cache_mib * 2**20)
        )
        self.fetch_s = []
        loader.on_loaded = self.fetch_s.append
        engine.start()
        try:
            records = asyncio.run(_Replay(context, engine, loader).run())
        finally:
            engine.stop()
        self.adapter_fetches = loader.fetches
        self.engine_stats = engine.stats().as_dict()
        return records


def _policy_stats(stats: dict) -> dict:
    """The engine stats a batch policy's results are read from."""
    keys = ("lora_mode_switches", "aborted_requests", "decode_steps", "preemptions")
    return {k: v for k, v in stats.items() if k in keys or k.startswith("batch_policy_")}


class _Replay:
    """One run's replay: a task per trace request, sleeping until its arrival time."""

    def __init__(self, context: RunContext, engine: Engine, loader: AdapterLoader):
        self.context = context
        self.engine = engine
        self.loader = loader
        self.start = 0.0
        self.deadline = 0.0

    def remaining_s(self) -> float | None:
        return time_left(self.deadline, time.monotonic())

    async def run(self) -> list[RequestRecord]:
        records = [
            RequestRecord(r.request_id, r.adapter, r.time_s, r.input_len, r.output_len)
            for r in self.context.trace
        ]
        # As the worker: the adapters' parsing runs on threads confined to one torch thread, so
        # only the engine's thread starts an OpenMP team (services/gpu_worker/engine/side_threads.py).
        asyncio.get_running_loop().set_default_executor(side_thread_pool(IO_THREADS, "bench-io"))
        self.start = time.monotonic()
        self.deadline = self.start + self.context.window_s
        tasks = [asyncio.create_task(self._serve(r, rec)) for r, rec in zip(self.context.trace, records)]
        sampler = asyncio.create_task(self._sample_pool())
        await asyncio.wait(tasks)
        sampler.cancel()
        return records

    async def _serve(self, request: TraceRequest, record: RequestRecord) -> None:
        await asyncio.sleep(max(0.0, self.start + request.time_s - time.monotonic()))
        try:
            await self._generate(request, record)
        finally:
            self.context.on_progress(1)

    async def _generate(self, request: TraceRequest, record: RequestRecord) -> None:
        adapter_id = self.context.adapters.name(request.adapter)
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def on_event(event: TokenEvent) -> None:  # engine thread
            now = time.monotonic() - self.start
            if event.token_id is not None:
                record.output_tokens += 1
                if record.first_token_s is None:
                    record.first_token_s = now
            if event.finish_reason is FinishReason.ERROR:
                record.error = event.error or "engine error"
            elif event.finish_reason is FinishReason.ABORTED:
                record.error = "aborted"
            elif event.finish_reason is not None and record.output_tokens == record.output_len:
                record.finish_s = now
            if event.finish_reason is not None:
                loop.call_soon_threadsafe(done.set_result, None)

        try:
            await asyncio.wait_for(self.loader.acquire(adapter_id), timeout=self.remaining_s())
        except TimeoutError:
            return
        try:
            self.engine.submit(
                GenerationRequest(
                    request.request_id,
                    self.context.prompt(request),
                    SamplingParams(max_tokens=request.output_len, ignore_eos=True),
                    adapter_id,
                ),
                on_event,
            )
            try:
                await asyncio.wait_for(asyncio.shield(done), timeout=self.remaining_s())
            except TimeoutError:
                self.engine.cancel(request.request_id)
                await done
        finally:
            self.loader.release(adapter_id)

    async def _sample_pool(self) -> None:
        if self.context.on_sample is None:
            return
        while True:
            self.context.on_sample(time.monotonic() - self.start, self.engine.stats().as_dict())
            await asyncio.sleep(SAMPLE_PERIOD_S)
