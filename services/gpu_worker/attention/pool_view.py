"""A pool's layout and its buffer's address arithmetic: what attention and KV writes need.

:class:`PoolLayout` is the pool's shape, derived from the model; :class:`PoolView` is a buffer of
that shape without the page allocator. An executor owns its buffers as views; the engine's
:class:`~services.gpu_worker.memory.unified_pool.UnifiedPool` puts its page allocator over the
executor's view, so the model and the attention over pool blocks read and write pages without
knowing who hands them out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch


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
    attention and KV writes need. An executor holds its pool as one; a same-host debtor holds one
    over a creditor's shared pool (``SharedCreditorPool``)."""

    def __init__(
        self, layout: PoolLayout, dtype: torch.dtype, buffer: torch.Tensor, shared_fd: int | None = None
    ):
        """``shared_fd``: the memfd behind ``buffer`` when it lives in shared memory, so that
        debtors on this host can map it (owned by the view: :meth:`close`)."""
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
        self._shared_fd = shared_fd

    @classmethod
    def zeros(cls, layout: PoolLayout, dtype: torch.dtype, device: torch.device | str = "cpu") -> PoolView:
        """A view over a new zero-filled private buffer of ``layout``'s size."""
        return cls(
            layout, dtype, torch.zeros(layout.num_pages * layout.page_elems, dtype=dtype, device=device)
        )

    @property
    def shared_fd(self) -> int | None:
        """The memfd behind a shared buffer (None: a private one)."""
        return self._shared_fd

    def close(self) -> None:
        """Let go of the shared memory's descriptor (the mappings stay valid while they live)."""
        if self._shared_fd is not None:
            os.close(self._shared_fd)
            self._shared_fd = None

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
