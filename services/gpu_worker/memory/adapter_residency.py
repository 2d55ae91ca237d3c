"""Which adapters are paged into the unified pool, who is using them, and LRU eviction.

One source of truth with explicit reference counts (the lesson of SGLang's LoRARegistry): a
running request holds a reference to its adapter; only adapters with no reference may be
evicted, least recently used first, when the pool needs pages (S-LoRA §5.1).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from services.gpu_worker.kernels.lora_segments import AdapterRows
from services.gpu_worker.lora.host_adapter import HostAdapter, ModuleKey
from services.gpu_worker.memory.page_allocator import PageUse, PoolExhausted
from services.gpu_worker.memory.unified_pool import UnifiedPool


@dataclass(frozen=True)
class PlacedModule:
    """Where one projection's LoRA rows sit in the pool, and its scale."""

    rows: AdapterRows
    scale: float


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


class AdapterResidency:
    """Adapters resident in the pool, by id, in LRU order."""

    def __init__(self, pool: UnifiedPool):
        self.pool = pool
        self._resident: OrderedDict[str, ResidentAdapter] = OrderedDict()
        self._placements = itertools.count()

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._resident

    def __len__(self) -> int:
        return len(self._resident)

    def ids(self) -> list[str]:
        return list(self._resident)

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
            self._resident.move_to_end(adapter.adapter_id)
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
            self._copy_rows(factors.a, a_offsets)
            self._copy_rows(factors.b_t, b_offsets)
            device = self.pool.device
            modules[key] = PlacedModule(
                rows=AdapterRows(
                    a_offsets=torch.tensor(a_offsets, dtype=torch.int64, device=device),
                    b_offsets=torch.tensor(b_offsets, dtype=torch.int64, device=device),
                ),
                scale=factors.scale,
            )
        self.pool.free([p for p in pages if p not in touched])  # the upper bound's unused pages
        resident = ResidentAdapter(
            adapter.adapter_id, sorted(touched), modules, adapter.nbytes, placement=next(self._placements)
        )
        self._resident[adapter.adapter_id] = resident
        return resident

    def _copy_rows(self, matrix: torch.Tensor, offsets: list[int]) -> None:
        # Rows placed back to back are copied in one go.
        width = matrix.shape[1]
        start = 0
        while start < len(offsets):
            end = start + 1
            while end < len(offsets) and offsets[end] == offsets[start] + (end - start) * width:
                end += 1
            self.pool.buffer[offsets[start] : offsets[start] + (end - start) * width].copy_(
                matrix[start:end].reshape(-1)
            )
            start = end

    def acquire(self, adapter_id: str) -> ResidentAdapter:
        resident = self._resident[adapter_id]
        resident.refcount += 1
        self._resident.move_to_end(adapter_id)
        return resident

    def release(self, adapter_id: str) -> None:
        resident = self._resident[adapter_id]
        if resident.refcount <= 0:
            raise RuntimeError(f"adapter {adapter_id} released more often than acquired")
        resident.refcount -= 1

    def idle_pages(self) -> int:
        return sum(len(r.pages) for r in self._resident.values() if r.refcount == 0)

    def make_room(self, pages: int, use: PageUse = PageUse.ADAPTER) -> None:
        """Evict idle adapters, least recently used first, until ``pages`` are free for ``use``.

        In a split pool evicting adapters frees nothing for KV, so a KV shortfall raises at once.
        """
        allocator = self.pool.allocator
        if allocator.free_pages_for(use) >= pages:
            return
        if use is PageUse.KV and not allocator.unified:
            raise PoolExhausted(pages, allocator.free_pages_for(use))
        if allocator.free_pages_for(use) + self.idle_pages() < pages:
            raise PoolExhausted(pages, allocator.free_pages_for(use))
        for adapter_id in list(self._resident):
            if allocator.free_pages_for(use) >= pages:
                break
            if self._resident[adapter_id].refcount == 0:
                self.evict(adapter_id)

    def evict(self, adapter_id: str) -> None:
        resident = self._resident.pop(adapter_id)
        if resident.refcount:
            self._resident[adapter_id] = resident
            raise RuntimeError(f"adapter {adapter_id} is in use by {resident.refcount} requests")
        self.pool.free(resident.pages)
