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
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.gpu_worker.memory.page_allocator import PageAllocator, PageUse, PoolUsage
from services.gpu_worker.memory.shared_memory import shared_zeros


@dataclass(frozen=True)
class PoolLayout:
    """Shape of the pool, derived from the model."""

    num_pages: int
    """Pages in the pool."""
    kv_block_tokens: int
    """Tokens of one layer's KV per page."""
    kv_dim: int
    """Width of one token's keys (= values) in one layer: ``num_kv_heads * head_dim``."""
    num_layers: int
    """Decoder layers; a block of tokens takes one page per layer."""

    @property
    def page_elems(self) -> int:
        return 2 * self.kv_block_tokens * self.kv_dim

    def same_blocks(self, other: PoolLayout) -> bool:
        """KV blocks of ``other`` mean the same as ours (tokens, layers, width): the same base
        model, so one worker may lend its blocks to the other."""
        return (self.kv_block_tokens, self.num_layers, self.kv_dim) == (
            other.kv_block_tokens,
            other.num_layers,
            other.kv_dim,
        )

    @staticmethod
    def pages_for_bytes(total_bytes: int, kv_block_tokens: int, kv_dim: int, dtype: torch.dtype) -> int:
        page_bytes = 2 * kv_block_tokens * kv_dim * torch.empty((), dtype=dtype).element_size()
        return max(1, total_bytes // page_bytes)


class PoolView:
    """A pool's buffer and the address arithmetic of its pages, without the allocator: what
    attention and KV writes need. A same-host debtor holds one over a creditor's shared pool
    (``SharedCreditorPool``); the pool's own process holds the :class:`UnifiedPool`."""

    def __init__(self, layout: PoolLayout, dtype: torch.dtype, buffer: torch.Tensor):
        if buffer.numel() != layout.num_pages * layout.page_elems or buffer.dtype != dtype:
            raise ValueError(
                f"a buffer of {buffer.numel()} {buffer.dtype} elements is not a pool of "
                f"{layout.num_pages} pages of {layout.page_elems} {dtype} elements"
            )
        self.layout = layout
        self.dtype = dtype
        self.device = buffer.device
        self.buffer = buffer
        self.kv_rows = buffer.view(-1, layout.kv_dim)

    @property
    def page_elems(self) -> int:
        return self.layout.page_elems

    def key_rows(self, pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Row index (in ``kv_rows``) of the key of ``slots`` in KV ``pages`` (same shapes)."""
        return pages * (2 * self.layout.kv_block_tokens) + slots

    def value_rows(self, pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return self.key_rows(pages, slots) + self.layout.kv_block_tokens

    def write_kv(
        self, pages: Sequence[int], slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Token ``i``'s key and value into slot ``slots[i]`` of KV page ``pages[i]``."""
        page_ids = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        slots = slots.to(device=self.device, dtype=torch.int64)
        self.kv_rows.index_copy_(0, self.key_rows(page_ids, slots), keys.to(self.device, self.dtype))
        self.kv_rows.index_copy_(0, self.value_rows(page_ids, slots), values.to(self.device, self.dtype))

    def write_rows(self, page: int, offset: int, rows: torch.Tensor) -> None:
        """Copy ``rows`` (2-D, contiguous) into ``page`` starting ``offset`` elements in."""
        start = page * self.page_elems + offset
        self.buffer[start : start + rows.numel()].copy_(rows.reshape(-1))


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
