"""KV blocks in this worker's unified pool: the local implementation of ``KvBlockAllocator``.

A block is one KV page per layer. Blocks lent to debtors come from here too (the lender
allocates through this allocator), so every KV page this allocator hands out is either used by
this worker's own requests or lent to exactly one debtor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence

import torch

from services.gpu_worker.attention.dist_attention import PartialAttention
from services.gpu_worker.attention.pool_block_attention import attend_pool_blocks
from services.gpu_worker.distkv.block_table import LocalBlock
from services.gpu_worker.distkv.kv_block_allocator import AttendSegment, KvRows
from services.gpu_worker.memory.page_allocator import PageUse
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.runtime.errors import FailedPrecondition, InvalidArgument


class LocalBlockAllocator:
    """Allocates, writes, frees and attends over blocks of ``pool``'s KV pages."""

    def __init__(self, pool: UnifiedPool):
        self.pool = pool
        self._allocated: set[LocalBlock] = set()
        self._cached: Counter[LocalBlock] = Counter()
        """Prefix-cache blocks adopted by borrowing requests, with how many hold each."""

    @property
    def block_tokens(self) -> int:
        return self.pool.layout.kv_block_tokens

    @property
    def num_layers(self) -> int:
        return self.pool.layout.num_layers

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation could take now (adapters share these pages and may take them)."""
        return self.pool.allocator.free_pages_for(PageUse.KV) // self.num_layers

    @property
    def allocated_blocks(self) -> int:
        return len(self._allocated)

    def allocate(self, count: int) -> list[LocalBlock]:
        """``count`` blocks, all or none (raises ``PoolExhausted``, allocating nothing)."""
        if count < 0:
            raise InvalidArgument(f"cannot allocate {count} blocks")
        layers = self.num_layers
        pages = self.pool.allocate(count * layers, PageUse.KV)
        blocks = [LocalBlock(tuple(pages[i : i + layers])) for i in range(0, len(pages), layers)]
        self._allocated.update(blocks)
        return blocks

    def adopt(self, pages: Sequence[Sequence[int]], cached: Collection[int] = ()) -> list[LocalBlock]:
        """Take over KV blocks whose pages (one per layer each) were allocated from the pool
        directly, by an engine request's page table: its KV stays where it is when the request
        starts to borrow. The blocks at indices ``cached`` belong to the prefix cache, which the
        request holds references in: attended over, never written nor freed here (a free only
        forgets them), and several requests may hold the same one."""
        blocks = [LocalBlock(tuple(block)) for block in pages]
        own = [block for index, block in enumerate(blocks) if index not in cached]
        if any(len(block.pages) != self.num_layers for block in blocks) or any(
            block in self._allocated or block in self._cached for block in own
        ):
            raise FailedPrecondition("adopted blocks must be new and have one page per layer")
        self._allocated.update(own)
        self._cached.update(block for index, block in enumerate(blocks) if index in cached)
        return blocks

    def write(self, layer: int, rows: KvRows[LocalBlock]) -> None:
        blocks = rows.blocks
        self._check_held(blocks)
        if any(block in self._cached for block in blocks):
            raise FailedPrecondition("a cached prefix block is read-only")
        self.pool.write_kv([block.pages[layer] for block in blocks], rows.slots, rows.keys, rows.values)

    def free(self, blocks: Sequence[LocalBlock]) -> None:
        self._check_held(blocks)
        if len(set(blocks)) != len(blocks):
            raise FailedPrecondition("the same block is freed twice in one call")
        own = [block for block in blocks if block in self._allocated]
        self._cached.subtract(block for block in blocks if block not in self._allocated)
        self._cached = +self._cached  # the prefix cache frees those pages, when it evicts them
        self._allocated.difference_update(own)
        self.pool.free([page for block in own for page in block.pages])

    def attend(self, layer: int, segments: Sequence[AttendSegment[LocalBlock]]) -> list[PartialAttention]:
        self._check_held([block for segment in segments for block in segment.blocks])
        return [
            attend_pool_blocks(
                self.pool,
                [block.pages[layer] for block in segment.blocks],
                segment.block_first_positions,
                segment.queries,
                segment.query_positions,
            )
            for segment in segments
        ]

    def page_table(self, blocks: Sequence[LocalBlock]) -> torch.Tensor:
        """int64 [num_layers, len(blocks)]: each block's page in each layer, the blocks checked
        once (a step's plan attends over the same blocks in every layer)."""
        self._check_held(blocks)
        pages = torch.tensor([block.pages for block in blocks], dtype=torch.int64, device=self.pool.device)
        return pages.reshape(len(blocks), self.num_layers).T.contiguous()

    def read(self, blocks: Sequence[LocalBlock]) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.pool.layout
        pages = self.page_table(blocks)
        # The pool as blocks of kv_block_tokens rows: page p holds key block 2p and value block 2p + 1.
        rows = self.pool.buffer.view(-1, layout.kv_block_tokens * layout.kv_dim)
        shape = (layout.num_layers, -1, layout.kv_dim)
        return rows[2 * pages].reshape(shape).clone(), rows[2 * pages + 1].reshape(shape).clone()

    def _check_held(self, blocks: Sequence[LocalBlock]) -> None:
        for block in blocks:
            if block not in self._allocated and block not in self._cached:
                raise FailedPrecondition(f"local block {block.pages} is not allocated (freed already?)")
