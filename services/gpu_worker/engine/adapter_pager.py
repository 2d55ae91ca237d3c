"""Adapters in the pool as the engine sees them: paged in on demand, held by running requests,
evicted when idle (through the residency's eviction policy), and merged into the base weights in
dLoRA's merged mode. Placement is decided here (accounting); the executor writes the rows, on
the copier's thread (``adapter_copier.py``): a page-in reserves the pages and returns, and the
adapter's requests start at a later step, once its rows are in. The running batch steps on
meanwhile: a request waits for its adapter, never the batch. What stays on the engine thread (the
residency's choice of pages and of each module's runs of rows; the per-row offsets are built on
the copier's thread) is held to a share of a step while a batch runs: a burst
of page-ins is spread over the next steps instead of stalling one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass

from services.gpu_worker.engine.adapter_copier import AdapterCopier
from services.gpu_worker.engine.engine_config import EngineConfig
from services.gpu_worker.engine.executor import Executor
from services.gpu_worker.engine.policies import make_batch_policy
from services.gpu_worker.engine.policies.batch_policy import UNMERGED, BatchPolicy, LoraMode, Merged
from services.gpu_worker.engine.request import EngineRequest
from services.gpu_worker.engine.step_plan import AdapterSlot
from services.gpu_worker.lora.host_adapter import HostAdapter
from services.gpu_worker.memory.adapter_residency import AdapterResidency, ResidentAdapter
from services.gpu_worker.memory.page_allocator import PoolExhausted
from services.gpu_worker.memory.prefix_cache import PrefixCache
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.runtime.eviction import EvictionPolicy

log = logging.getLogger("loramesh.engine")

PAGE_IN_STEP_SHARE = 0.02
"""Engine-thread time page-ins may take per step while a batch runs, as a share of the step
before (at least one page-in starts per step, whatever it costs)."""


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


@dataclass(frozen=True)
class ResidentSummary:
    """The resident adapters as the stats report them."""

    ids: tuple[str, ...] = ()
    """In eviction order, the first to go first."""
    idle_pages: int = 0
    """Pages of resident adapters no request holds and no pin keeps (evictable at once)."""
    wasted_elems: int = 0
    """Pool elements of resident adapters' pages their rows do not use."""


class AdapterPager:
    """Pages adapters in and out of the executor's pool and switches the LoRA mode."""

    def __init__(
        self,
        executor: Executor,
        pool: UnifiedPool,
        prefix_cache: PrefixCache | None = None,
        on_copied: Callable[[], None] | None = None,
        eviction: EvictionPolicy | None = None,
    ):
        """``pool``: the engine's pool over the executor's buffer; ``prefix_cache``: cached KV blocks, evicted before idle adapters when the pool needs
        room; ``on_copied``: told (on the copier's thread) when an adapter's rows are in;
        ``eviction``: the order idle adapters leave the pool in (default least recently used)."""
        self.executor = executor
        self.residency = AdapterResidency(
            pool, self._copy_later, self._evicted, eviction=eviction, prefix_cache=prefix_cache
        )
        self.copier = AdapterCopier(executor.load_adapter, pool.device, on_copied)
        self._copies: dict[str, Future[float]] = {}
        """Adapters whose rows are being written, each held (refcount) by its copy so that it is
        not evicted half-written; settled on the engine thread."""
        self._summary: ResidentSummary | None = ResidentSummary()
        """The stats' view of the residency, rebuilt only after it changed (None)."""
        self.merged: str | None = None
        """The adapter merged into the base weights now (dLoRA's merged mode), if any."""
        self.mode_switches = 0
        self.on_paged_in: Callable[[float], None] | None = None
        """Told the seconds each adapter took to be paged into the pool, from the page-in to its
        rows being in (engine thread)."""
        self._budget_s: float | None = None
        """Engine-thread seconds page-ins may still take this step (None: no limit)."""
        self._started = 0
        """Page-ins started this step."""
        self._deferred: list[str] = []
        """Preloads past a step's budget, started at the next steps."""
        self._copy_here = False
        """The page-in under way copies on the engine thread (no running batch would wait)."""
        self._slots: dict[str, AdapterSlot] = {}
        """Each resident adapter's slot of its load in force: the same object step after step, so
        the executor sees an unchanged slot by identity (``DecodeEncoder``), not by comparing."""

    def begin_step(self, step_s: float | None) -> None:
        """A step begins; ``step_s``: how long the step before took while a batch runs (None:
        nothing runs, page-ins are not limited)."""
        self._budget_s = None if step_s is None else PAGE_IN_STEP_SHARE * step_s
        self._started = 0

    def _may_start(self) -> bool:
        return self._budget_s is None or self._started == 0 or self._budget_s > 0

    def pages_needed(self, adapter: HostAdapter) -> int:
        """Pages ``adapter`` takes in the pool once paged in (an upper bound)."""
        return self.residency.pages_needed(self.executor.prepare_adapter(adapter))

    def page_in(self, adapter: HostAdapter, budgeted: bool = True) -> bool:
        """Start paging ``adapter`` into the pool (unless ``budgeted`` and this step's budget is
        spent: then at a later call), or mark it recently used when it is resident; whether its
        rows are in the pool now. ``PoolExhausted`` when evicting every idle adapter does not
        make room."""
        placed = self.executor.prepare_adapter(adapter)
        adapter_id = adapter.adapter_id
        if adapter_id in self.residency:
            self.residency.load(placed)  # marks it recently used
            self._summary = None
            return self.ready(adapter_id)
        if budgeted and not self._may_start():
            return False
        started = time.perf_counter()
        self.residency.load(placed)  # reserves its pages; its copy starts (_copy_later)
        self.residency.acquire(adapter_id)  # the copy's hold, until it is settled
        self._summary = None
        self._started += 1
        if self._budget_s is not None:
            self._budget_s -= time.perf_counter() - started
        return False

    def _copy_later(self, adapter: HostAdapter, resident: ResidentAdapter) -> None:
        copier = self.copier
        start = copier.copy_here if self._copy_here else copier.start
        self._copies[adapter.adapter_id] = start(adapter, resident)

    def ready(self, adapter_id: str) -> bool:
        """Whether ``adapter_id``'s rows are in the pool (it is resident and not being copied)."""
        copy = self._copies.get(adapter_id)
        if copy is None:
            return adapter_id in self.residency
        if not copy.done():
            return False
        self._settle(adapter_id)
        return True

    def has_work(self) -> bool:
        """Whether a copy has ended and is not settled yet, or preloads wait for a step."""
        return bool(self._deferred) or any(copy.done() for copy in self._copies.values())

    def settle(self) -> None:
        """Release the copies that ended (engine thread, before a step): their adapters become
        idle residents, which their requests may hold."""
        for adapter_id in [a for a, copy in self._copies.items() if copy.done()]:
            self._settle(adapter_id)

    def wait(self, adapter_id: str) -> None:
        """Block until ``adapter_id``'s copy (if any) has ended, and settle it."""
        if adapter_id in self._copies:
            self._settle(adapter_id)  # its result() blocks until the copy ends

    def _settle(self, adapter_id: str) -> None:
        copy = self._copies.pop(adapter_id)
        self.residency.release(adapter_id)
        self._summary = None
        try:
            seconds = copy.result()
        except BaseException:
            # Its pages hold no adapter: give them back; the caller's step fails as a failed
            # synchronous copy failed it.
            self.residency.evict(adapter_id)
            raise
        if self.on_paged_in is not None:
            self.on_paged_in(seconds)

    def preload(self, adapter_ids: list[str], host_adapters: dict[str, HostAdapter]) -> None:
        """Start paging these adapters in ahead of their requests, where idle adapters make room;
        those past this step's budget (and those deferred before) at the next steps."""
        queued, self._deferred = [*self._deferred, *adapter_ids], []
        for adapter_id in queued:
            adapter = host_adapters.get(adapter_id)
            if adapter is None:  # removed from the host since the preload was asked for
                continue
            if adapter_id not in self.residency and not self._may_start():
                self._deferred.append(adapter_id)
                continue
            try:
                self.page_in(adapter)
            except PoolExhausted:
                log.info("no room to preload adapter %s now; it will be paged in when used", adapter_id)

    def set_pinned(self, adapter_ids: Iterable[str]) -> None:
        """Make ``adapter_ids`` the adapters the pool never evicts (engine thread)."""
        self.residency.set_pinned(adapter_ids)
        self._summary = None

    def acquire(self, request: EngineRequest, adapter: HostAdapter, block: bool) -> bool:
        """Hold ``request``'s adapter for as long as the request runs, if its rows are in the
        pool; else start paging it in and return False (``block``: wait for the rows instead,
        when no running batch would wait with the caller). ``PoolExhausted``."""
        self._copy_here = block  # nothing runs that the copy could overlap: make it here, now
        try:
            paged_in = self.page_in(adapter, budgeted=not block)
        finally:
            self._copy_here = False
        if not paged_in:
            if not block:
                return False
            self.wait(adapter.adapter_id)
        self.residency.acquire(adapter.adapter_id)
        self._summary = None
        request.holds_adapter = True
        return True

    def release(self, request: EngineRequest) -> None:
        if request.holds_adapter:
            self.residency.release(request.spec.adapter_id)
            self._summary = None
            request.holds_adapter = False

    def _evicted(self, adapter_id: str) -> None:
        self.executor.evict_adapter(adapter_id)
        self._slots.pop(adapter_id, None)
        self._summary = None

    def close(self) -> None:
        """Finish the copies under way and stop the copier."""
        self.copier.close()

    def slot(self, request: EngineRequest) -> AdapterSlot | None:
        """Where ``request``'s adapter rows are for a plan (None: base model, merged, or an
        activated LoRA whose invocation its prompt lacks)."""
        adapter_id = request.spec.adapter_id
        if adapter_id is None or adapter_id == self.merged or request.adapter_from is None:
            return None
        placement = self.residency.get(adapter_id).placement
        slot = self._slots.get(adapter_id)
        if slot is None or slot.placement != placement:
            slot = self._slots[adapter_id] = AdapterSlot(adapter_id, placement)
        return slot

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
        if isinstance(mode, Merged) and (
            mode.adapter_id not in host_adapters or host_adapters[mode.adapter_id].invocation_tokens
        ):
            # Removed from the host meanwhile, or an activated LoRA, which applies to part of its
            # requests' positions only (PEFT cannot merge one either): nothing to merge.
            mode = UNMERGED
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

    def summary(self) -> ResidentSummary:
        """The resident adapters for the stats. Rebuilt only after a page-in, hold, release or
        eviction: a decode step that changes none of them costs nothing per resident adapter."""
        if self._summary is None:
            residency = self.residency
            page_elems = residency.pool.layout.page_elems
            element = residency.pool.buffer.element_size()
            waste = 0
            for adapter_id in residency.ids():
                resident = residency.get(adapter_id)
                waste += len(resident.pages) * page_elems - resident.nbytes // element
            self._summary = ResidentSummary(tuple(residency.ids()), residency.idle_pages(), waste)
        return self._summary
