"""Brings adapters onto the worker: fetch (once, even when many requests ask at the same time),
parse off the event loop, hand the host copy to the engine. S-LoRA §5.2's prefetch: a request's
adapter starts moving as soon as the request arrives, or earlier via ``Prefetch``."""

from __future__ import annotations

import asyncio
import logging

import torch

from services.gpu_worker.adapter_source import AdapterSource
from services.gpu_worker.engine.engine import Engine
from services.gpu_worker.lora.host_adapter import HostAdapter, parse_peft_adapter

log = logging.getLogger("loramesh.worker.adapters")


class AdapterLoader:
    def __init__(self, source: AdapterSource, engine: Engine, dtype: torch.dtype):
        self.source = source
        self.engine = engine
        self.dtype = dtype
        self._inflight: dict[str, asyncio.Task[HostAdapter]] = {}

    async def ensure(self, adapter_id: str) -> HostAdapter:
        """The adapter's host copy, pulling it if this worker does not have it yet."""
        existing = self.engine.host_adapters.get(adapter_id)
        if existing is not None:
            return existing
        task = self._inflight.get(adapter_id)
        if task is None:
            task = asyncio.create_task(self._pull(adapter_id))
            self._inflight[adapter_id] = task
            task.add_done_callback(lambda _: self._inflight.pop(adapter_id, None))
        return await asyncio.shield(task)

    def prefetch(self, adapter_ids: list[str]) -> list[str]:
        started = []
        for adapter_id in adapter_ids:
            if adapter_id in self.engine.host_adapters or adapter_id in self._inflight:
                continue
            task = asyncio.create_task(self.ensure(adapter_id))
            task.add_done_callback(_log_failure(adapter_id))
            started.append(adapter_id)
        return started

    async def _pull(self, adapter_id: str) -> HostAdapter:
        config, weights = await self.source.fetch(adapter_id)
        adapter = await asyncio.to_thread(parse_peft_adapter, adapter_id, config, weights, self.dtype)
        self.engine.add_adapter(adapter)
        log.info(
            "adapter %s on this worker (max rank %d, %d bytes)", adapter_id, adapter.max_rank, adapter.nbytes
        )
        return adapter


def _log_failure(adapter_id: str):
    def done(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.warning("prefetch of adapter %s failed: %s", adapter_id, task.exception())

    return done
