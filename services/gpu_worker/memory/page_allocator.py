"""Which pages of the unified pool are free and who holds the others. Pure bookkeeping: no
tensors, so policies around it are testable alone."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class PageUse(Enum):
    KV = "kv"
    ADAPTER = "adapter"


class PoolExhausted(Exception):
    """Not enough free pages; the caller evicts, preempts or waits."""

    def __init__(self, wanted: int, free: int):
        super().__init__(f"wanted {wanted} pages, {free} free")
        self.wanted = wanted
        self.free = free


@dataclass(frozen=True)
class PoolUsage:
    """A snapshot for metrics and load reports."""

    total_pages: int
    free_pages: int
    kv_pages: int
    adapter_pages: int


class PageAllocator:
    """A free list over ``num_pages`` page ids, with the use each allocated page is put to.

    Unified (the default): any free page serves either use. With ``adapter_region_pages`` the
    pool is split into two fixed regions, the last ``adapter_region_pages`` pages for adapters and
    the rest for KV, each with its own free list: the "no unified memory" ablation of S-LoRA §7.
    """

    def __init__(self, num_pages: int, adapter_region_pages: int | None = None):
        if num_pages <= 0:
            raise ValueError("the pool needs at least one page")
        if adapter_region_pages is not None and not 0 < adapter_region_pages < num_pages:
            raise ValueError(
                f"adapter_region_pages must be within (0, {num_pages}), got {adapter_region_pages}"
            )
        self.num_pages = num_pages
        self.unified = adapter_region_pages is None
        # Lowest ids first keeps a lightly used pool compact (and page tables short-ranged).
        if self.unified:
            shared = list(range(num_pages - 1, -1, -1))
            self._free = {PageUse.KV: shared, PageUse.ADAPTER: shared}
        else:
            split = num_pages - adapter_region_pages
            self._free = {
                PageUse.KV: list(range(split - 1, -1, -1)),
                PageUse.ADAPTER: list(range(num_pages - 1, split - 1, -1)),
            }
        self._use: dict[int, PageUse] = {}
        self._counts = {PageUse.KV: 0, PageUse.ADAPTER: 0}

    @property
    def free_pages(self) -> int:
        if self.unified:
            return len(self._free[PageUse.KV])
        return len(self._free[PageUse.KV]) + len(self._free[PageUse.ADAPTER])

    def free_pages_for(self, use: PageUse) -> int:
        """Pages an allocation for ``use`` can draw from now."""
        return len(self._free[use])

    def allocate(self, count: int, use: PageUse) -> list[int]:
        """``count`` pages for ``use``, all or none (raises :class:`PoolExhausted`)."""
        free = self._free[use]
        if count > len(free):
            raise PoolExhausted(count, len(free))
        if count == 0:
            return []
        # Slices and a dict update, not a Python step per page: an adapter takes thousands of
        # pages, and its page-in runs on the engine thread.
        pages = free[-count:]
        pages.reverse()  # the order pops from the end would give: lowest ids first
        del free[-count:]
        self._use.update(dict.fromkeys(pages, use))
        self._counts[use] += count
        return pages

    def free(self, pages: list[int]) -> None:
        use_of = self._use
        missing = [page for page in pages if page not in use_of]
        if missing:
            raise ValueError(f"page {missing[0]} is not allocated")
        if len(set(pages)) != len(pages):
            raise ValueError("a page is freed twice in one call")
        uses = list(map(use_of.pop, pages))
        kv = uses.count(PageUse.KV)
        self._counts[PageUse.KV] -= kv
        self._counts[PageUse.ADAPTER] -= len(uses) - kv
        if self.unified:  # one free list, in the order freed
            self._free[PageUse.KV].extend(pages)
            return
        for use in (PageUse.KV, PageUse.ADAPTER):
            self._free[use].extend(page for page, used in zip(pages, uses) if used is use)

    def usage(self) -> PoolUsage:
        return PoolUsage(
            total_pages=self.num_pages,
            free_pages=self.free_pages,
            kv_pages=self._counts[PageUse.KV],
            adapter_pages=self._counts[PageUse.ADAPTER],
        )
