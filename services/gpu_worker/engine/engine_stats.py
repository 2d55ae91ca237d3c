"""What the engine reports about itself: one frozen snapshot per step, taken by the engine thread
outside the forward pass, read from any thread. The one source of the ``WorkerLoad`` heartbeat
(``service.py``), the ``Stats`` RPC (``servicer.py``) and the metrics (``worker_metrics.py``).

The pool's page counts are the exception, read "now" when the snapshot is handed out
(:func:`with_pool_now`): other workers' lending calls take and return pages between steps, and
the heartbeat must not report pages lent a step ago as free.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from services.gpu_worker.attention.pool_view import PoolLayout
from services.gpu_worker.distkv import RManager
from services.gpu_worker.engine.request import EngineRequest
from services.gpu_worker.memory.prefix_cache import PrefixCache
from services.gpu_worker.memory.unified_pool import UnifiedPool

if TYPE_CHECKING:
    from services.gpu_worker.engine.engine import Engine


@dataclass(frozen=True)
class EngineStats:
    """The engine after its latest step."""

    queue: int = 0
    """Requests waiting to start (handed over and not yet taken up included)."""
    running: int = 0
    """Requests in the running batch."""
    free_pages: int = 0
    """Pool pages free now, unused cached prefix blocks' included (read when handed out)."""
    total_pages: int = 0
    """Pool pages in all."""
    kv_pages: int = 0
    """Pool pages holding KV now, lent ones and cached prefix blocks in use included, unused
    cached blocks not (read when handed out)."""
    adapter_pages: int = 0
    """Pool pages holding adapter rows now (read when handed out)."""
    free_blocks: int = 0
    """KV blocks (one page per layer) free now, what the lender can lend: unused cached blocks
    not included (they are evicted by the engine thread only; read when handed out)."""
    total_blocks: int = 0
    """KV blocks the pool holds at most."""
    fragmentation: float = 0.0
    """Share of allocated pool elements holding no data (unfilled KV blocks, adapter page ends)."""
    resident_adapters: tuple[str, ...] = ()
    """Adapters paged into the pool, the first to be evicted first."""
    idle_adapter_pages: int = 0
    """Pages of resident adapters no running request uses and no pin keeps (evictable at once)."""
    preemptions: int = 0
    """Requests preempted since start (their KV freed, recomputed later)."""
    borrowed_blocks: dict[str, int] = field(default_factory=dict)
    """KV blocks this worker holds on each creditor."""
    running_adapters: tuple[str | None, ...] = ()
    """The adapter of each running request (None: the base model)."""
    waiting_adapters: tuple[str | None, ...] = ()
    """The adapter of each queued request taken up by the engine thread."""
    decode_steps: int = 0
    """Steps run since start."""
    tokens_per_s: float = 0.0
    """Generation rate over the last second or more (read when handed out)."""
    lora_mode_merged: int = 0
    """1 while an adapter is merged into the base weights (dLoRA)."""
    lora_mode_switches: int = 0
    """Merges and unmerges since start."""
    aborted_requests: int = 0
    """Requests the batch policy aborted since start."""
    batch_policy_decisions: dict[str, float] = field(default_factory=dict)
    """The batch policy's own counters and knobs (``BatchPolicy.decisions``)."""
    prefix_cache_hit_blocks: int = 0
    """Prompt KV blocks found in the prefix cache since start (their prefill skipped)."""
    prefix_cache_missed_blocks: int = 0
    """Whole prompt KV blocks looked up in the prefix cache and not found since start."""
    prefix_cache_blocks: int = 0
    """KV blocks in the prefix cache now, used by running requests or not."""
    prefix_cache_evictable_pages: int = 0
    """Pages of cached KV blocks no running request uses now (freed first when the pool needs
    pages)."""
    fallbacks: tuple[str, ...] = ()
    """Configured features the executor cannot run and the engine replaced at start, e.g.
    ``dlora->fcfs`` (no merging) or ``borrow->preempt`` (no KV lending)."""

    def as_dict(self) -> dict:
        """Flat, for results files: each policy decision as ``batch_policy_<name>``."""
        flat = asdict(self)
        decisions = flat.pop("batch_policy_decisions")
        return {**flat, **{f"batch_policy_{k}": v for k, v in decisions.items()}}


def take_stats(engine: Engine) -> EngineStats:
    """``engine``'s snapshot, pool pages aside (engine thread, between steps)."""
    running, waiting, resident = engine.running, engine.waiting, engine.adapters.summary()
    return EngineStats(
        queue=len(waiting) + engine.hand_over.queued_requests(),
        running=len(running),
        fragmentation=round(fragmentation(engine.pool, running, resident.wasted_elems), 4),
        resident_adapters=resident.ids,
        idle_adapter_pages=resident.idle_pages,
        preemptions=engine.scheduler.preemptions,
        borrowed_blocks=engine.rm.borrowed(),
        running_adapters=tuple(r.spec.adapter_id for r in running),
        waiting_adapters=waiting.adapter_ids(),
        decode_steps=engine.steps,
        lora_mode_merged=int(engine.adapters.merged is not None),
        lora_mode_switches=engine.adapters.mode_switches,
        aborted_requests=engine.scheduler.aborted,
        batch_policy_decisions=dict(engine.policy.decisions()),
        fallbacks=engine.fallbacks,
        **_prefix_cache_stats(engine.prefix_cache),
    )


def _prefix_cache_stats(cache: PrefixCache | None) -> dict[str, int]:
    if cache is None:
        return {}
    stats = cache.stats()
    return {
        "prefix_cache_hit_blocks": stats.hit_blocks,
        "prefix_cache_missed_blocks": stats.missed_blocks,
        "prefix_cache_blocks": stats.cached_blocks,
        "prefix_cache_evictable_pages": cache.evictable_pages(),
    }


def with_pool_now(stats: EngineStats, pool: UnifiedPool, rm: RManager, tokens_per_s: float) -> EngineStats:
    """``stats`` with the pool's pages and blocks as they are now, and the current rate. Pages of
    cached prefix blocks no request uses count as free, not as KV (as vLLM counts cached but
    unreferenced blocks): they are evicted the moment pages are needed."""
    usage = pool.usage()
    cached = stats.prefix_cache_evictable_pages  # changes on the engine thread only, at steps
    return replace(
        stats,
        free_pages=usage.free_pages + cached,
        total_pages=usage.total_pages,
        kv_pages=usage.kv_pages - cached,
        adapter_pages=usage.adapter_pages,
        free_blocks=rm.local.free_blocks,
        total_blocks=pool.layout.num_pages // pool.layout.num_layers,
        tokens_per_s=tokens_per_s,
    )


@dataclass(frozen=True)
class AdapterUsage:
    """What each adapter was asked for on this engine since start (per adapter id)."""

    requests: dict[str, int] = field(default_factory=dict)
    """Requests taken up by the engine thread."""
    tokens: dict[str, int] = field(default_factory=dict)
    """Tokens generated."""


@dataclass(frozen=True)
class PoolTokens:
    """The unified pool in KV-token units."""

    total: int
    free: int
    adapter_tokens: dict[str, int]
    """Footprint of each adapter with a host copy here, were it paged in."""


def tokens_of_pages(layout: PoolLayout, pages: int) -> int:
    """``pages`` of the pool in KV tokens, as the scheduler's migration and prefetch policies
    count memory: one token of KV is ``num_layers / kv_block_tokens`` pages."""
    return pages * layout.kv_block_tokens // layout.num_layers


def pool_tokens(pool: UnifiedPool, adapter_tokens: dict[str, int]) -> PoolTokens:
    """The pool in KV-token units; ``adapter_tokens``: the footprint of each adapter with a host
    copy, were it paged in (:func:`tokens_of_pages`)."""
    usage = pool.usage()
    return PoolTokens(
        total=tokens_of_pages(pool.layout, usage.total_pages),
        free=tokens_of_pages(pool.layout, usage.free_pages),
        adapter_tokens=adapter_tokens,
    )


def fragmentation(pool: UnifiedPool, running: list[EngineRequest], adapter_waste: int) -> float:
    """Share of allocated pool elements holding no data: KV blocks the ``running`` requests have
    not filled yet, and ``adapter_waste`` (page ends adapters could not use). Paging makes
    external fragmentation zero by construction."""
    layout = pool.layout
    kv_waste = sum(
        (r.kv.capacity - r.num_computed) * 2 * layout.kv_dim * layout.num_layers
        for r in running
        if r.table is None
    )
    usage = pool.usage()
    allocated = (usage.kv_pages + usage.adapter_pages) * layout.page_elems
    return (kv_waste + adapter_waste) / allocated if allocated else 0.0


class TokenRate:
    """Tokens generated per second, over readings at least a second apart."""

    def __init__(self) -> None:
        self._mark = (time.monotonic(), 0)
        self._rate = 0.0

    def read(self, tokens_generated: int) -> float:
        """The rate since the previous reading at least a second ago (``tokens_generated``: the
        count since start)."""
        now = time.monotonic()
        since, before = self._mark
        if now - since >= 1.0:
            self._rate = (tokens_generated - before) / (now - since)
            self._mark = (now, tokens_generated)
        return self._rate
