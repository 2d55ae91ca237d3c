"""Brings adapters onto the worker and keeps their host copies within a RAM budget.

Fetch happens once even when many requests ask at the same time, parsing runs off the event
loop, and the host copy is handed to the engine. S-LoRA §5.2's prefetch: a request's adapter
starts moving as soon as the request arrives, or earlier via ``Prefetch``.

Host copies are reference counted (one reference per request between :meth:`acquire` and
:meth:`release`); when their bytes exceed the budget, unreferenced ones are dropped least
recently used first and fetched again (from the store's RAM tier or disk) when next asked for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import torch

from services.gpu_worker.adapter_source import AdapterSource
from services.gpu_worker.engine.engine import Engine
from services.gpu_worker.lora.host_adapter import HostAdapter, parse_peft_adapter

log = logging.getLogger("loramesh.worker.adapters")


class AdapterLoader:
    def __init__(
        self, source: AdapterSource, engine: Engine, dtype: torch.dtype, host_budget_bytes: int | None = None
    ):
        """``host_budget_bytes``: RAM for host copies of adapters; None: unbounded."""
        self.source = source
        self.engine = engine
        self.dtype = dtype
        self.host_budget_bytes = host_budget_bytes
        self._inflight: dict[str, asyncio.Task[HostAdapter]] = {}
        self._refs: dict[str, int] = {}
        self._lru: OrderedDict[str, int] = OrderedDict()
        """Host copies this loader added, least recently used first, with their sizes."""
        self.fetches = 0
        """Adapters pulled from the source so far (re-fetches after a drop included)."""
        self.on_loaded: Callable[[float], None] | None = None
        """Told the seconds each pull took, from asking the source to the host copy ready."""

    @property
    def host_bytes(self) -> int:
        return sum(self._lru.values())

    async def ensure(self, adapter_id: str) -> HostAdapter:
        """The adapter's host copy, pulling it if this worker does not have it now."""
        existing = self.engine.host_adapters.get(adapter_id)
        if existing is not None:
            if adapter_id in self._lru:
                self._lru.move_to_end(adapter_id)
            return existing
        task = self._inflight.get(adapter_id)
        if task is None:
            task = asyncio.create_task(self._pull(adapter_id))
            self._inflight[adapter_id] = task
            task.add_done_callback(lambda _: self._inflight.pop(adapter_id, None))
        return await asyncio.shield(task)

    async def acquire(self, adapter_id: str) -> HostAdapter:
        """:meth:`ensure`, holding a reference so the host copy stays until :meth:`release`."""
        self._refs[adapter_id] = self._refs.get(adapter_id, 0) + 1
        try:
            return await self.ensure(adapter_id)
        except BaseException:
            self.release(adapter_id)
            raise

    def public_name(self, adapter_id: str) -> str:
        """The name users know ``adapter_id`` by (the store's ``owner/name``, a directory's name)."""
        return self.source.public_name(adapter_id)

    def fetch_waiters(self) -> dict[str, int]:
        """Requests waiting for their adapter's host copy, per adapter being pulled: queued on
        this worker, though not yet handed to the engine."""
        return {a: self._refs[a] for a in self._inflight if self._refs.get(a)}

    def release(self, adapter_id: str) -> None:
        count = self._refs.get(adapter_id, 0)
        if count <= 0:
            raise RuntimeError(f"adapter {adapter_id} released more often than acquired")
        if count == 1:
            del self._refs[adapter_id]
            self._shrink()
        else:
            self._refs[adapter_id] = count - 1

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
        started = time.perf_counter()
        config, weights = await self.source.fetch(adapter_id)
        adapter = await asyncio.to_thread(parse_peft_adapter, adapter_id, config, weights, self.dtype)
        self.engine.add_adapter(adapter)
        if self.on_loaded is not None:
            self.on_loaded(time.perf_counter() - started)
        self.fetches += 1
        self._lru[adapter_id] = adapter.nbytes
        self._shrink()
        log.debug(
            "adapter %s on this worker (max rank %d, %d bytes)", adapter_id, adapter.max_rank, adapter.nbytes
        )
        return adapter

    def _shrink(self) -> None:
        """Drop unreferenced host copies, least recently used first, while over the budget."""
        if self.host_budget_bytes is None:
            return
        total = self.host_bytes
        for adapter_id in list(self._lru):
            if total <= self.host_budget_bytes:
                break
            if self._refs.get(adapter_id) or adapter_id in self._inflight:
                continue
            total -= self._lru.pop(adapter_id)
            self.engine.remove_adapter(adapter_id)


def _log_failure(adapter_id: str):
    def done(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.warning("prefetch of adapter %s failed: %s", adapter_id, task.exception())

    return done
