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
    """A free list over ``num_pages`` page ids, with the use each allocated page is put to."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError("the pool needs at least one page")
        self.num_pages = num_pages
        # Lowest ids first keeps a lightly used pool compact (and page tables short-ranged).
        self._free = list(range(num_pages - 1, -1, -1))
        self._use: dict[int, PageUse] = {}
        self._counts = {PageUse.KV: 0, PageUse.ADAPTER: 0}

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def allocate(self, count: int, use: PageUse) -> list[int]:
        """``count`` pages for ``use``, all or none (raises :class:`PoolExhausted`)."""
        if count > len(self._free):
            raise PoolExhausted(count, len(self._free))
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._use[page] = use
        self._counts[use] += count
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            use = self._use.pop(page, None)
            if use is None:
                raise ValueError(f"page {page} is not allocated")
            self._counts[use] -= 1
            self._free.append(page)

    def usage(self) -> PoolUsage:
        return PoolUsage(
            total_pages=self.num_pages,
            free_pages=len(self._free),
            kv_pages=self._counts[PageUse.KV],
            adapter_pages=self._counts[PageUse.ADAPTER],
        )
