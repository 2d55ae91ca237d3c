"""Which adapters are paged into the unified pool, who is using them, and which goes first.

One source of truth with explicit reference counts (the lesson of SGLang's LoRARegistry): a
running request holds a reference to its adapter; only adapters with no reference may be
evicted, in the order of an eviction policy (least recently used first by default, S-LoRA §5.1),
when the pool needs pages.

Residency is accounting: it chooses the pages and the row offsets. Writing the rows there is the
caller's (``write_rows``): by default into this pool's buffer; the engine passes its executor's,
which may write a shard of them into the pool of every rank of a tensor-parallel group.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.gpu_worker.kernels.lora_segments import AdapterRows
from services.gpu_worker.lora.host_adapter import HostAdapter, ModuleKey
from services.gpu_worker.memory.page_allocator import PageUse, PoolExhausted
from services.gpu_worker.memory.prefix_cache import PrefixCache
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.runtime.eviction import EvictionPolicy, LRUEviction


@dataclass(frozen=True)
class PlacedModule:
    """Where one projection's LoRA rows sit in the pool, and its scale."""

    rows: AdapterRows
    scale: float
    a_offsets: tuple[int, ...]
    """``rows.a_offsets`` on the host: where an executor writes the A rows (no device sync)."""
    b_offsets: tuple[int, ...]
    """``rows.b_offsets`` on the host."""


@dataclass
class ResidentAdapter:
    adapter_id: str
    pages: list[int]
    modules: dict[ModuleKey, PlacedModule]
    nbytes: int
    placement: int
    """Unique to this load: an adapter paged out and in again gets a new one, so (adapter,
    placement) names where its rows are without comparing page lists."""
    refcount: int = 0
    """Running requests using it; evictable only at 0."""


def _pages_upper_bound(adapter: HostAdapter, page_elems: int) -> int:
    """Pages the adapter needs if no two of its pages are adjacent (no row may cross a page)."""
    pages, offset = 1, 0
    for factors in adapter.modules.values():
        for width, count in ((factors.a.shape[1], factors.rank), (factors.b_t.shape[1], factors.rank)):
            if width > page_elems:
                raise ValueError(f"a LoRA row of {width} elements does not fit a page of {page_elems}")
            for _ in range(count):
                if offset + width > page_elems:
                    pages, offset = pages + 1, 0
                offset += width
    return pages


def _regions(pages: list[int], page_elems: int) -> list[tuple[int, int]]:
    """Runs of physically adjacent pages as ``(first element, elements)``: rows may cross page
    boundaries inside a run, which keeps each projection's rows back to back (one view)."""
    regions: list[list[int]] = []
    for page in sorted(pages):
        if regions and regions[-1][0] + regions[-1][1] == page * page_elems:
            regions[-1][1] += page_elems
        else:
            regions.append([page * page_elems, page_elems])
    return [(start, length) for start, length in regions]


RowWriter = Callable[[HostAdapter, ResidentAdapter], None]
"""Writes an adapter's rows at the offsets of its placement."""


def write_rows(buffer: torch.Tensor, adapter: HostAdapter, resident: ResidentAdapter) -> None:
    """Copy ``adapter``'s A and B rows into ``buffer`` (a pool's) where ``resident`` placed them."""
    for key, factors in adapter.modules.items():
        placed = resident.modules[key]
        _copy_rows(buffer, factors.a, placed.a_offsets)
        _copy_rows(buffer, factors.b_t, placed.b_offsets)


def _copy_rows(buffer: torch.Tensor, matrix: torch.Tensor, offsets: tuple[int, ...]) -> None:
    # Rows placed back to back are copied in one go.
    width = matrix.shape[1]
    start = 0
    while start < len(offsets):
        end = start + 1
        while end < len(offsets) and offsets[end] == offsets[start] + (end - start) * width:
            end += 1
        buffer[offsets[start] : offsets[start] + (end - start) * width].copy_(matrix[start:end].reshape(-1))
        start = end


class AdapterResidency:
    """Adapters resident in the pool, by id, in their eviction policy's order."""

    def __init__(
        self,
        pool: UnifiedPool,
        write: RowWriter | None = None,
        on_evict: Callable[[str], None] | None = None,
        eviction: EvictionPolicy | None = None,
        prefix_cache: PrefixCache | None = None,
    ):
        """``write``: what writes a loaded adapter's rows (default: into ``pool``'s buffer);
        ``on_evict``: told each adapter evicted; ``eviction``: the order idle adapters go in
        (default least recently used first); ``prefix_cache``: cached KV blocks, which give their
        pages back first when the pool needs room."""
        self.pool = pool
        self.prefix_cache = prefix_cache
        self._write = write or (lambda adapter, resident: write_rows(pool.buffer, adapter, resident))
        self._on_evict = on_evict
        self._eviction = eviction or LRUEviction()
        self._resident: dict[str, ResidentAdapter] = {}
        self._placements = itertools.count()

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._resident

    def __len__(self) -> int:
        return len(self._resident)

    def ids(self) -> list[str]:
        """Resident adapters, the first to be evicted first."""
        return self._eviction.order()

    def get(self, adapter_id: str) -> ResidentAdapter | None:
        return self._resident.get(adapter_id)

    def pages_needed(self, adapter: HostAdapter) -> int:
        """Pages to have free before loading ``adapter`` (an upper bound; extras are returned)."""
        return _pages_upper_bound(adapter, self.pool.page_elems)

    def load(self, adapter: HostAdapter) -> ResidentAdapter:
        """Page ``adapter`` in (a no-op when resident), evicting idle adapters to make room.

        Raises ``PoolExhausted`` when even evicting every idle adapter is not enough.
        """
        resident = self._resident.get(adapter.adapter_id)
        if resident is not None:
            self._eviction.touch(adapter.adapter_id)
            return resident
        page_elems = self.pool.page_elems
        needed = _pages_upper_bound(adapter, page_elems)
        self.make_room(needed)
        pages = self.pool.allocate(needed, PageUse.ADAPTER)
        regions = iter(_regions(pages, page_elems))
        region_start, region_len = next(regions)
        used = 0
        touched: set[int] = set()

        def place(width: int, count: int) -> list[int]:
            nonlocal region_start, region_len, used
            offsets = []
            for _ in range(count):
                if used + width > region_len:
                    region_start, region_len = next(regions)
                    used = 0
                offset = region_start + used
                offsets.append(offset)
                touched.update(range(offset // page_elems, (offset + width - 1) // page_elems + 1))
                used += width
            return offsets

        modules = {}
        for key, factors in adapter.modules.items():
            a_offsets = place(factors.a.shape[1], factors.rank)
            b_offsets = place(factors.b_t.shape[1], factors.rank)
            device = self.pool.device
            modules[key] = PlacedModule(
                rows=AdapterRows(
                    a_offsets=torch.tensor(a_offsets, dtype=torch.int64, device=device),
                    b_offsets=torch.tensor(b_offsets, dtype=torch.int64, device=device),
                ),
                scale=factors.scale,
                a_offsets=tuple(a_offsets),
                b_offsets=tuple(b_offsets),
            )
        self.pool.free([p for p in pages if p not in touched])  # the upper bound's unused pages
        resident = ResidentAdapter(
            adapter.adapter_id, sorted(touched), modules, adapter.nbytes, placement=next(self._placements)
        )
        self._write(adapter, resident)
        self._resident[adapter.adapter_id] = resident
        self._eviction.touch(adapter.adapter_id)
        return resident

    def acquire(self, adapter_id: str) -> ResidentAdapter:
        resident = self._resident[adapter_id]
        resident.refcount += 1
        self._eviction.touch(adapter_id)
        return resident

    def release(self, adapter_id: str) -> None:
        resident = self._resident[adapter_id]
        if resident.refcount <= 0:
            raise RuntimeError(f"adapter {adapter_id} released more often than acquired")
        resident.refcount -= 1

    def idle_pages(self) -> int:
        return sum(len(r.pages) for r in self._resident.values() if r.refcount == 0)

    def make_room(self, pages: int, use: PageUse = PageUse.ADAPTER) -> None:
        """Evict unused cached prefix blocks, then idle adapters, each in its eviction order, until
        ``pages`` are free for ``use`` (raises ``PoolExhausted``, evicting nothing, when even
        evicting all of them is not enough).

        In a split pool evicting adapters frees nothing for KV, and cached KV blocks nothing for
        adapters.
        """
        allocator = self.pool.allocator
        if allocator.free_pages_for(use) >= pages:
            return
        # Unused cached prefix blocks go before idle adapters: an adapter is needed before any
        # of its requests can start, a cached prefix only saves recomputing it. In a split pool
        # cached blocks (KV pages) make room only for KV, and adapters only for adapters.
        cache = self.prefix_cache if allocator.unified or use is PageUse.KV else None
        cached = cache.evictable_pages() if cache is not None else 0
        idle_pages = self.idle_pages() if allocator.unified or use is PageUse.ADAPTER else 0
        if allocator.free_pages_for(use) + cached + idle_pages < pages:
            raise PoolExhausted(pages, allocator.free_pages_for(use))
        if cache is not None:
            cache.make_room(pages, use)
        idle = [adapter_id for adapter_id, r in self._resident.items() if r.refcount == 0]
        for adapter_id in self._eviction.victims(idle):
            if allocator.free_pages_for(use) >= pages:
                break
            self.evict(adapter_id)

    def evict(self, adapter_id: str) -> None:
        resident = self._resident[adapter_id]
        if resident.refcount:
            raise RuntimeError(f"adapter {adapter_id} is in use by {resident.refcount} requests")
        del self._resident[adapter_id]
        self._eviction.remove(adapter_id)
        self.pool.free(resident.pages)
        if self._on_evict is not None:
            self._on_evict(adapter_id)
