"""Requests' KV: pages reserved in the local pool, grown per token, handed to the KV overflow
when the pool runs dry (``distkv/overflow.py``: preemption, or DistKV-LLM's borrowing from other
workers with ``kv_overflow: borrow``), and released.

A request's KV is in its ``KvTable`` (local pages, the fast path) until the pool cannot hold its
next block while borrowing is on: from then on all its blocks, local and remote, are in a block
table of the rManager (``EngineRequest.table``).

With a :class:`PrefixCache` a request starts with the cached blocks of its prompt's longest
cached prefix and prefills from the first uncached position; once prefilled, its whole prompt
blocks join the cache. A request that starts to borrow hands its blocks to the rManager; the
cached ones stay the cache's (the request's ``KvTable`` keeps its references to them and the
rManager reads them, never writes or frees them), and it adds no block to the cache.
"""

from __future__ import annotations

from collections.abc import Callable

from services.gpu_worker.distkv import KvOverflow, Preemption, RManager
from services.gpu_worker.engine.request import EngineRequest
from services.gpu_worker.memory.adapter_residency import AdapterResidency
from services.gpu_worker.memory.page_allocator import PageUse, PoolExhausted
from services.gpu_worker.memory.prefix_cache import BlockKey, PrefixCache


class KvReservation:
    """Reserves, grows and releases requests' KV in the pool and, through its overflow, beyond it."""

    def __init__(
        self,
        rm: RManager,
        residency: AdapterResidency,
        prefix_cache: PrefixCache | None = None,
        overflow: Callable[[Callable[[int], None], Callable[[], int]], KvOverflow] | None = None,
    ):
        """``residency``: idle adapters (and unused cached blocks) are evicted to make room for
        KV; ``prefix_cache``: where prompt blocks are shared (None: off); ``overflow``: makes the
        KV overflow from this pool's :meth:`make_room` and :meth:`room_blocks` (the DistKV wing's
        ``DistKv.kv_overflow``; None: preemption)."""
        self.rm = rm
        self.residency = residency
        self.prefix_cache = prefix_cache
        self.overflow: KvOverflow = (
            Preemption() if overflow is None else overflow(self.make_room, self.room_blocks)
        )
        """Where a request's KV goes when the pool cannot hold it: preemption or borrowing."""

    def reuse_prefix(self, request: EngineRequest, prompt_keys: Callable[[], list[BlockKey] | None]) -> None:
        """Start a waiting request's KV with the cached blocks of its longest cached prompt prefix
        and its prefill after them. ``prompt_keys``: the chain keys of its prompt's whole blocks
        (None: it bypasses the cache), asked only when the cache is on and it has no KV yet."""
        cache = self.prefix_cache
        if cache is None or request.num_computed or request.kv.blocks:
            return
        keys = prompt_keys()
        if keys is None:
            return
        block = self.rm.block_tokens
        request.prompt_block_keys = tuple(keys)
        # Its last token is always computed: its logits are what the next token is drawn from.
        usable = keys[: (request.total_len - 1) // block]
        cached = cache.acquire_prefix(usable, looked_up=len(keys))
        if cached:
            request.kv.attach_cached(usable[: len(cached)], cached)
            request.num_computed = len(cached) * block

    def cache_prompt(self, request: EngineRequest) -> None:
        """After ``request``'s prefill: its whole prompt blocks not cached yet join the cache (it
        keeps a reference; a block cached meanwhile by another request stays its own)."""
        keys, request.prompt_block_keys = request.prompt_block_keys, ()
        if self.prefix_cache is None or request.table is not None:
            return
        for index, key in enumerate(keys):
            if index not in request.kv.shared and self.prefix_cache.insert(key, request.kv.blocks[index]):
                request.kv.share(index, key)

    def reserve(self, request: EngineRequest, tokens: int) -> None:
        """Make ``request``'s KV hold ``tokens`` tokens (``PoolExhausted``: it could not)."""
        if request.table is not None:  # spilled: it grows where its overflow keeps it
            self.overflow.spill(request, tokens)
            return
        needed = request.kv.pages_needed(tokens)
        if not needed:
            return
        try:
            self.make_room(needed)
            request.kv.reserve(tokens)
        except PoolExhausted:
            self.overflow.spill(request, tokens)

    def reserve_drafts(self, request: EngineRequest, tokens: int) -> bool:
        """Make ``request``'s local KV hold ``tokens`` tokens, its drafts' positions, from free
        pages only (False, nothing reserved, when they do not suffice): a draft is not worth
        evicting, borrowing or preempting for. Rejected drafts' positions are rolled back by
        their request's ``num_computed`` (their KV masked out, then overwritten); their pages
        stay its own, for its next drafts, until it ends."""
        needed = request.kv.pages_needed(tokens)
        if needed > self.residency.pool.allocator.free_pages_for(PageUse.KV):
            return False
        request.kv.reserve(tokens)
        return True

    def make_room(self, pages: int) -> None:
        """Free ``pages`` pages for KV, evicting unused cached blocks and idle adapters."""
        self.residency.make_room(pages, PageUse.KV)

    def release(self, request: EngineRequest) -> list[str]:
        """Free ``request``'s KV; the creditors found gone while returning borrowed blocks (the
        caller recomputes the requests that had blocks there)."""
        request.kv.release()  # after a hand-over: only its references to cached blocks
        return self.overflow.release(request)

    def lost_with(self, creditor: str, running: list[EngineRequest]) -> list[EngineRequest]:
        """``creditor`` is gone with the blocks it held: the ``running`` requests that had some
        (to recompute)."""
        return self.overflow.lost_with(creditor, running)

    def room_blocks(self) -> int:
        """KV blocks the pool could give now: free ones and unused cached ones."""
        cached = self.prefix_cache.evictable_pages() if self.prefix_cache is not None else 0
        return self.rm.local.free_blocks + cached // self.rm.local.num_layers

    def pool_can_never_hold(self, running: list[EngineRequest]) -> bool:
        """A request that does not fit now never will: nothing runs, nothing is lent out (idle
        adapters were evicted to make room), and no other worker lends to this one or they
        would never lend enough together."""
        if running or self.rm.lender.lent_blocks:
            return False
        return self.overflow.hopeless()
