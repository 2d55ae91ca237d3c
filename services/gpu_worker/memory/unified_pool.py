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

import os
import threading

import torch

from services.gpu_worker.attention.pool_view import PoolLayout, PoolView
from services.gpu_worker.memory.page_allocator import PageAllocator, PageUse, PoolUsage
from services.gpu_worker.memory.shared_memory import shared_zeros


class UnifiedPool(PoolView):
    """The buffer, its allocator, and the address arithmetic of both kinds of page."""

    def __init__(
        self,
        layout: PoolLayout,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        adapter_region_pages: int | None = None,
        shared: bool = False,
    ):
        """``adapter_region_pages``: None (unified) or the size of a fixed adapter-only region
        (see :class:`PageAllocator`; only the no-unified-memory ablation sets it). ``shared``: the
        buffer lives in shared memory (a CPU pool only), so that debtors on this host can map it
        (``shared_fd``)."""
        numel = layout.num_pages * layout.page_elems
        self.shared_fd: int | None = None
        """The memfd behind a shared buffer (None: a private one)."""
        if shared:
            if torch.device(device).type != "cpu":
                raise ValueError(f"only a CPU pool can be shared with other processes, not {device}")
            buffer, self.shared_fd = shared_zeros(numel, dtype, "loramesh-unified-pool")
        else:
            buffer = torch.zeros(numel, dtype=dtype, device=device)
        super().__init__(layout, dtype, buffer)
        self.allocator = PageAllocator(layout.num_pages, adapter_region_pages)
        # The engine thread and the lending RPCs (blocks lent to other workers) both take and
        # give back pages; PageAllocator itself is not thread-safe.
        self._lock = threading.Lock()

    def close(self) -> None:
        """Let go of the shared memory's descriptor (the mappings stay valid while they live)."""
        if self.shared_fd is not None:
            os.close(self.shared_fd)
            self.shared_fd = None

    def allocate(self, count: int, use: PageUse) -> list[int]:
        with self._lock:
            return self.allocator.allocate(count, use)

    def free(self, pages: list[int]) -> None:
        with self._lock:
            self.allocator.free(pages)

    def usage(self) -> PoolUsage:
        with self._lock:
            return self.allocator.usage()
