"""Adapters in the pool as the engine sees them: paged in on demand, held by running requests,
evicted when idle (through the residency's eviction policy), and merged into the base weights in
dLoRA's merged mode. Placement is decided here (accounting); the executor writes the rows."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from services.gpu_worker.engine.engine_config import EngineConfig
from services.gpu_worker.engine.executor import Executor
from services.gpu_worker.engine.policies import make_batch_policy
from services.gpu_worker.engine.policies.batch_policy import UNMERGED, BatchPolicy, LoraMode, Merged
from services.gpu_worker.engine.request import EngineRequest
from services.gpu_worker.engine.step_plan import AdapterSlot
from services.gpu_worker.lora.host_adapter import HostAdapter
from services.gpu_worker.memory.adapter_residency import AdapterResidency
from services.gpu_worker.memory.page_allocator import PoolExhausted
from services.gpu_worker.memory.prefix_cache import PrefixCache

log = logging.getLogger("loramesh.engine")


def runnable_batch_policy(
    policy: BatchPolicy, config: EngineConfig, executor: Executor
) -> tuple[BatchPolicy, tuple[str, ...]]:
    """``policy``, or fcfs when it merges adapters (dlora) and ``executor`` cannot; with the
    fallbacks taken (:attr:`EngineStats.fallbacks`). ValueError: dlora with deterministic serving."""
    fallbacks: tuple[str, ...] = ()
    if policy.name == "dlora" and not executor.supports_merging:
        log.warning("this executor cannot merge adapters: the dlora batch policy runs as fcfs")
        policy, fallbacks = make_batch_policy("fcfs"), ("dlora->fcfs",)
    if config.deterministic and policy.name == "dlora":
        raise ValueError(
            "deterministic serving cannot use the dlora batch policy: merging an adapter into the "
            "base weights changes its requests' numerics (run it with deterministic off)"
        )
    return policy, fallbacks


class AdapterPager:
    """Pages adapters in and out of the executor's pool and switches the LoRA mode."""

    def __init__(self, executor: Executor, prefix_cache: PrefixCache | None = None):
        """``prefix_cache``: cached KV blocks, evicted before idle adapters when the pool needs room."""
        self.executor = executor
        self.residency = AdapterResidency(
            executor.pool, executor.load_adapter, executor.evict_adapter, prefix_cache=prefix_cache
        )
        self.merged: str | None = None
        """The adapter merged into the base weights now (dLoRA's merged mode), if any."""
        self.mode_switches = 0
        self.on_paged_in: Callable[[float], None] | None = None
        """Told the seconds each adapter took to be paged into the pool (engine thread)."""

    def pages_needed(self, adapter: HostAdapter) -> int:
        """Pages ``adapter`` takes in the pool once paged in (an upper bound)."""
        return self.residency.pages_needed(self.executor.prepare_adapter(adapter))

    def page_in(self, adapter: HostAdapter) -> None:
        """Page ``adapter`` into the pool (a no-op when resident), timing a real page-in;
        ``PoolExhausted`` when evicting every idle adapter does not make room."""
        placed = self.executor.prepare_adapter(adapter)
        if adapter.adapter_id in self.residency:
            self.residency.load(placed)  # marks it recently used
            return
        started = time.perf_counter()
        self.residency.load(placed)
        if self.on_paged_in is not None:
            self.on_paged_in(time.perf_counter() - started)

    def preload(self, adapter_ids: list[str], host_adapters: dict[str, HostAdapter]) -> None:
        """Page these adapters in ahead of their requests, where idle adapters make room."""
        for adapter_id in adapter_ids:
            adapter = host_adapters.get(adapter_id)
            if adapter is None:  # removed from the host since the preload was asked for
                continue
            try:
                self.page_in(adapter)
            except PoolExhausted:
                log.info("no room to preload adapter %s now; it will be paged in when used", adapter_id)

    def acquire(self, request: EngineRequest, adapter: HostAdapter) -> None:
        """Page ``request``'s adapter in and hold it while the request runs (``PoolExhausted``)."""
        self.page_in(adapter)
        self.residency.acquire(adapter.adapter_id)
        request.holds_adapter = True

    def release(self, request: EngineRequest) -> None:
        if request.holds_adapter:
            self.residency.release(request.spec.adapter_id)
            request.holds_adapter = False

    def slot(self, request: EngineRequest) -> AdapterSlot | None:
        """Where ``request``'s adapter rows are for a plan (None: base model or merged)."""
        adapter_id = request.spec.adapter_id
        if adapter_id is None or adapter_id == self.merged:
            return None
        return AdapterSlot(adapter_id, self.residency.get(adapter_id).placement)

    @property
    def mode(self) -> LoraMode:
        """The LoRA mode the base weights are in."""
        return UNMERGED if self.merged is None else Merged(self.merged)

    def runs_in_mode(self, request: EngineRequest) -> bool:
        """In merged mode only the merged adapter's requests can run (the base is changed)."""
        return self.merged is None or request.spec.adapter_id == self.merged

    def switch_mode(self, mode: LoraMode, host_adapters: dict[str, HostAdapter]) -> float:
        """Merge or unmerge so the base weights are in ``mode``; the seconds it took."""
        if mode == self.mode:
            return 0.0
        if isinstance(mode, Merged) and mode.adapter_id not in host_adapters:
            mode = UNMERGED  # removed from the host meanwhile: nothing to merge
            if mode == self.mode:
                return 0.0
        started = time.monotonic()
        self.executor.unmerge()
        self.merged = None
        if isinstance(mode, Merged):
            self.executor.merge(host_adapters[mode.adapter_id])
            self.merged = mode.adapter_id
        self.mode_switches += 1
        log.debug("LoRA mode -> %s", mode)
        return time.monotonic() - started

    def wasted_elems(self) -> int:
        """Pool elements of resident adapters' pages their rows do not use."""
        page_elems = self.residency.pool.layout.page_elems
        element = self.residency.pool.buffer.element_size()
        waste = 0
        for adapter_id in self.residency.ids():
            resident = self.residency.get(adapter_id)
            waste += len(resident.pages) * page_elems - resident.nbytes // element
        return waste
