"""KV blocks of prompt prefixes kept in the unified pool and shared between requests (automatic
prefix caching, as vLLM's).

A block is named by a chain hash: the sha256 of the previous block's key and this block's token
ids, the first block's "previous key" being the request's key space — the adapter id and the
sha256 of its content, or the base model. So a block matches only when every token before it
and the adapter (this exact version of it) match: KV is never shared across adapters, nor across
two versions of one adapter id (the bug class of llama.cpp#26207 and vllm#30931).

An activated LoRA (aLoRA) is the base model before its invocation, so a request of one keys
the blocks wholly before its activation position in the base model's key space (they are shared
with base requests and with other aLoRA adapters' requests) and the rest in its adapter's,
joined with that position (:func:`activated_block_keys`).

A key space is also salted with the request's namespace, who may share its blocks (vLLM's
``cache_salt``, issue 50): the gateway names the tenant, or the salt a client passed. A cached
prompt is a timing side channel (a hit's first token comes sooner), so by default it reaches
only the tenant that sent it; docs/security.md says what timing still tells.

The cluster prefix tier (``services/gpu_worker/prefix_tier.py``) announces the keys a worker caches and evicts
(its :class:`PrefixJournal`) and moves cached blocks between workers by key
(:meth:`PrefixCache.export_blocks`, :meth:`PrefixCache.import_blocks`): a key names its block's
content, so a block fetched under the key asked for is the block a recompute would make.

Only whole blocks are cached, and only blocks of the prompt. One source of truth with reference
counts (like :class:`AdapterResidency`): a request using a cached block holds a reference; a
block with none stays in the pool, evictable in its eviction policy's order (least recently used
first) when the pool needs pages — before an idle adapter is evicted or a running request is
preempted. Cached blocks are read-only: a request writes only to its own blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.gpu_worker.memory.page_allocator import PageUse, PoolExhausted
from services.gpu_worker.memory.prefix_journal import PrefixJournal
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.runtime.eviction import EvictionPolicy, LRUEviction
from services.runtime.prefix_keys import (  # the keys' one implementation, shared with the gateway
    BASE_MODEL_KEY_SPACE,
    BlockKey,
    activated_block_keys,
    adapter_key_space,
    block_keys,
    namespaced_key_space,
)

__all__ = [
    "BASE_MODEL_KEY_SPACE",
    "BlockKey",
    "CachedBlock",
    "PrefixCache",
    "PrefixCacheStats",
    "activated_block_keys",
    "adapter_key_space",
    "block_keys",
    "namespaced_key_space",
]


@dataclass
class CachedBlock:
    """One cached KV block."""

    pages: tuple[int, ...]
    """Its KV page in every layer (``pages[layer]``)."""
    refcount: int = 0
    """Requests using it; evictable only at 0."""


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters since start and the cache now."""

    hit_blocks: int
    """Prompt blocks found cached (their prefill skipped)."""
    missed_blocks: int
    """Whole prompt blocks looked up and computed: not cached, after the first that was not, or
    holding the prompt's last token (always computed)."""
    cached_blocks: int
    """Blocks in the cache now, used or not."""
    evictable_blocks: int
    """Cached blocks no request uses now (freed first when the pool needs pages)."""
    evicted_blocks: int
    """Blocks evicted to make room since start."""


class PrefixCache:
    """Cached KV blocks by chain key, with reference counts and an eviction order (engine thread)."""

    def __init__(
        self, pool: UnifiedPool, eviction: EvictionPolicy | None = None, journal: PrefixJournal | None = None
    ):
        """``eviction``: the order unused blocks go in (default least recently used first);
        ``journal``: told each key cached and evicted (the cluster tier's announcements)."""
        self.pool = pool
        self.journal = journal
        self._eviction = eviction or LRUEviction()
        self._blocks: dict[BlockKey, CachedBlock] = {}
        self._evictable_blocks = 0
        self._hit_blocks = 0
        self._missed_blocks = 0
        self._evicted_blocks = 0

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._blocks

    def refcount(self, key: BlockKey) -> int:
        """References to a cached block (0 when it is not cached)."""
        block = self._blocks.get(key)
        return 0 if block is None else block.refcount

    def acquire_prefix(self, keys: Sequence[BlockKey], looked_up: int) -> list[tuple[int, ...]]:
        """Take a reference to the longest cached run of ``keys`` from the first; returns those
        blocks' pages. ``looked_up``: the whole prompt blocks the caller asked about (counted as
        hits or misses)."""
        pages = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                break
            self._hold(key, block)
            pages.append(block.pages)
        self._hit_blocks += len(pages)
        self._missed_blocks += max(0, looked_up - len(pages))
        return pages

    def insert(self, key: BlockKey, pages: Sequence[int]) -> bool:
        """Adopt a request's computed block under ``key``, the request holding a reference; False
        (nothing adopted, the request keeps its block) when ``key`` is cached already."""
        if key in self._blocks:
            return False
        block = CachedBlock(tuple(pages), refcount=1)
        self._blocks[key] = block
        self._eviction.touch(key)
        if self.journal is not None:
            self.journal.cached(key)
        return True

    def cached_run(self, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys``, from the first, are cached (no reference taken)."""
        run = 0
        for key in keys:
            if key not in self._blocks:
                break
            run += 1
        return run

    def export_blocks(self, keys: Sequence[BlockKey]) -> torch.Tensor:
        """A copy of the KV of the leading cached run of ``keys``: ``[blocks, num_layers,
        2 * kv_block_tokens, kv_dim]`` (each page's keys then values). Engine thread."""
        layout = self.pool.layout
        run = [self._blocks[key].pages for key in keys[: self.cached_run(keys)]]
        if not run:
            return torch.empty(
                0, layout.num_layers, 2 * layout.kv_block_tokens, layout.kv_dim, dtype=self.pool.dtype
            )
        ids = torch.tensor(run, dtype=torch.int64, device=self.pool.device)
        return self._pages()[ids].to("cpu", copy=True)

    def import_blocks(self, keys: Sequence[BlockKey], kv: torch.Tensor) -> int:
        """Cache ``kv`` (as :meth:`export_blocks` makes it) under ``keys``, unused (evictable),
        from the first until the pool has no room left but what requests hold; a key cached
        already keeps its block. Returns the leading keys cached now. Engine thread."""
        layers = self.pool.layout.num_layers
        held: list[BlockKey] = []  # referenced until the end, so that making room spares them
        try:
            for key, block in zip(keys, kv, strict=True):
                if key in self._blocks:
                    self._hold(key, self._blocks[key])
                else:
                    self.make_room(layers, PageUse.KV)
                    try:
                        pages = self.pool.allocate(layers, PageUse.KV)
                    except PoolExhausted:
                        break
                    ids = torch.tensor(pages, dtype=torch.int64, device=self.pool.device)
                    self._pages()[ids] = block.to(self.pool.device, self.pool.dtype)
                    self.insert(key, pages)
                held.append(key)
        finally:
            self.release(held)
        return len(held)

    def release(self, keys: Sequence[BlockKey]) -> None:
        """Drop a request's references to the blocks of ``keys`` (in block order). The last block
        is marked used first, so that a chain is evicted from its tail: its head is what the most
        requests share."""
        for key in reversed(keys):
            block = self._blocks[key]
            if block.refcount <= 0:
                raise RuntimeError("a cached KV block released more often than acquired")
            block.refcount -= 1
            if block.refcount == 0:
                self._evictable_blocks += 1
            self._eviction.touch(key)

    def evictable_pages(self) -> int:
        """Pages evicting every unused cached block would free."""
        return self._evictable_blocks * self.pool.layout.num_layers

    def make_room(self, pages: int, use: PageUse) -> None:
        """Evict unused blocks, in eviction order, until ``pages`` pages are free for ``use`` or
        none is left (the caller evicts further or gives up)."""
        allocator = self.pool.allocator
        if allocator.free_pages_for(use) >= pages or not self._evictable_blocks:
            return
        unused = [key for key, block in self._blocks.items() if block.refcount == 0]
        for key in self._eviction.victims(unused):
            if allocator.free_pages_for(use) >= pages:
                break
            self._evict(key)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            hit_blocks=self._hit_blocks,
            missed_blocks=self._missed_blocks,
            cached_blocks=len(self._blocks),
            evictable_blocks=self._evictable_blocks,
            evicted_blocks=self._evicted_blocks,
        )

    def _pages(self) -> torch.Tensor:
        """The pool as ``[num_pages, 2 * kv_block_tokens, kv_dim]`` (a KV page: keys then values)."""
        layout = self.pool.layout
        return self.pool.kv_rows.view(layout.num_pages, 2 * layout.kv_block_tokens, layout.kv_dim)

    def _hold(self, key: BlockKey, block: CachedBlock) -> None:
        if block.refcount == 0:
            self._evictable_blocks -= 1
        block.refcount += 1
        self._eviction.touch(key)

    def _evict(self, key: BlockKey) -> None:
        block = self._blocks.pop(key)
        self._eviction.remove(key)
        self._evictable_blocks -= 1
        self._evicted_blocks += 1
        self.pool.free(list(block.pages))
        if self.journal is not None:
            self.journal.evicted(key)
