"""Per-request KV page tables over the unified pool; whole prompt blocks may be shared blocks of
the :class:`PrefixCache` (read-only: the request holds a reference, not the pages)."""

from __future__ import annotations

import torch

from services.gpu_worker.memory.page_allocator import PageUse
from services.gpu_worker.memory.prefix_cache import BlockKey, PrefixCache
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.runtime.errors import FailedPrecondition


class KvTable:
    """The KV pages of one request: ``blocks[b][layer]`` is the page holding tokens
    ``b*B .. b*B+B-1`` of that layer (``B`` = the pool's ``kv_block_tokens``)."""

    def __init__(self, pool: UnifiedPool, prefix_cache: PrefixCache | None = None):
        """``prefix_cache``: where its shared blocks are cached (None: it shares none)."""
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.blocks: list[list[int]] = []
        self.shared: dict[int, BlockKey] = {}
        """Block index -> cache key of each block owned by the prefix cache (released there, not
        freed); the other blocks are the request's own."""
        self._table: torch.Tensor | None = None
        self._frozen: tuple[tuple[int, ...], ...] | None = None

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.layout.kv_block_tokens

    def pages_needed(self, num_tokens: int) -> int:
        """Pages to allocate so that ``num_tokens`` tokens fit."""
        block = self.pool.layout.kv_block_tokens
        missing_blocks = max(0, -(-num_tokens // block) - len(self.blocks))
        return missing_blocks * self.pool.layout.num_layers

    def reserve(self, num_tokens: int) -> None:
        """Grow to hold ``num_tokens`` tokens (raises ``PoolExhausted``, allocating nothing)."""
        needed = self.pages_needed(num_tokens)
        if needed == 0:
            return
        pages = self.pool.allocate(needed, PageUse.KV)
        layers = self.pool.layout.num_layers
        self.blocks.extend(pages[i : i + layers] for i in range(0, needed, layers))
        self._table = self._frozen = None

    def attach_cached(self, keys: list[BlockKey], blocks: list[tuple[int, ...]]) -> None:
        """Start an empty table with cached prefix ``blocks`` (their references already taken)."""
        if self.blocks:
            raise FailedPrecondition("cached prefix blocks go into an empty KV table")
        self.blocks = [list(pages) for pages in blocks]
        self.shared = dict(enumerate(keys))
        self._table = self._frozen = None

    def share(self, index: int, key: BlockKey) -> None:
        """Block ``index`` now belongs to the prefix cache under ``key`` (the table holds a reference)."""
        self.shared[index] = key

    def release(self) -> None:
        if self.shared:
            self.prefix_cache.release([self.shared[i] for i in sorted(self.shared)])
        for index, block in enumerate(self.blocks):  # none after a hand-over
            if index not in self.shared:
                self.pool.free(block)
        self.blocks, self.shared = [], {}
        self._table = self._frozen = None

    def hand_over(self) -> list[list[int]]:
        """Empty the table without freeing its pages; returns them (per block, one page per layer)
        for a new owner (the rManager, when the request starts to borrow). The shared blocks'
        pages stay the prefix cache's: this table keeps their references (``shared``) and gives
        them back at :meth:`release`, so the new owner must not free those."""
        blocks, self.blocks, self._table, self._frozen = self.blocks, [], None, None
        return blocks

    def frozen_blocks(self) -> tuple[tuple[int, ...], ...]:
        """``blocks`` as tuples, one object until the pages change: a step plan carries it, and
        the step builder sees by identity that a request's table is the one it already has."""
        if self._frozen is None:
            self._frozen = tuple(map(tuple, self.blocks))
        return self._frozen

    def table(self) -> torch.Tensor:
        """``[num_blocks, num_layers]`` int64 page ids on the pool's device."""
        if self._table is None:
            self._table = torch.tensor(self.blocks, dtype=torch.int64, device=self.pool.device).reshape(
                -1, self.pool.layout.num_layers
            )
        return self._table

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value row indices ``[len(positions), num_layers]`` for token ``positions``."""
        block = self.pool.layout.kv_block_tokens
        pages = self.table()[positions // block]
        slots = (positions % block).unsqueeze(1)
        return self.pool.key_rows(pages, slots), self.pool.value_rows(pages, slots)
