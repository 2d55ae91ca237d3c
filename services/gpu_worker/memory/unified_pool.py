"""One preallocated buffer holding KV cache pages and LoRA weight pages (S-LoRA's Unified Paging).

A page is ``page_elems`` elements of the model dtype. Two kinds of data live in pages:

- KV cache: one page holds one layer's keys and values for ``kv_block_tokens`` consecutive
  tokens of one request: ``[K rows | V rows]``, each row ``kv_dim`` wide. Viewing the buffer as
  rows of ``kv_dim`` elements, token slot ``s`` of page ``p`` has its key at row
  ``p * 2B + s`` and its value at row ``p * 2B + B + s`` (``B`` = ``kv_block_tokens``).
- LoRA weights: an adapter's A rows (length ``in_features``) and Bᵀ rows (length
  ``out_features``) packed into pages; a row never straddles two pages, so each row is one
  contiguous run the kernels address by its element offset.

Because both come from the same allocator there is no static split between KV and adapters:
idle adapters make room for KV and the reverse (DESIGN §5).
"""

from __future__ import annotations

import threading

from services.gpu_worker.attention.pool_view import PoolView
from services.gpu_worker.memory.page_allocator import PageAllocator, PageUse, PoolUsage


class UnifiedPool(PoolView):
    """The engine's pool: the page allocator over an executor's buffer (its :class:`PoolView`),
    with the address arithmetic of both kinds of page. The executor owns the buffer and closes
    it; the engine owns the allocator and does all page accounting here."""

    def __init__(self, view: PoolView, adapter_region_pages: int | None = None):
        """``adapter_region_pages``: None (unified) or the size of a fixed adapter-only region
        (see :class:`PageAllocator`; only the no-unified-memory ablation sets it)."""
        super().__init__(view.layout, view.dtype, view.buffer)
        self.view = view
        """The executor's buffer this pool allocates pages of."""
        self.allocator = PageAllocator(view.layout.num_pages, adapter_region_pages)
        # The engine thread and the lending RPCs (blocks lent to other workers) both take and
        # give back pages; PageAllocator itself is not thread-safe.
        self._lock = threading.Lock()

    @property
    def shared_fd(self) -> int | None:
        return self.view.shared_fd

    def allocate(self, count: int, use: PageUse) -> list[int]:
        with self._lock:
            return self.allocator.allocate(count, use)

    def free(self, pages: list[int]) -> None:
        with self._lock:
            self.allocator.free(pages)

    def usage(self) -> PoolUsage:
        with self._lock:
            return self.allocator.usage()
