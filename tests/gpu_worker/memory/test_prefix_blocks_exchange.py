"""The prefix cache's side of the cluster tier: its journal of cached and evicted keys (bounded,
a full set after overflow), and blocks exported by key from one pool and imported into another
byte for byte, evictable there, stopping where the pool has no room."""

from __future__ import annotations

import torch

from services.gpu_worker.attention.pool_view import PoolLayout, PoolView
from services.gpu_worker.memory.page_allocator import PageUse
from services.gpu_worker.memory.prefix_cache import PrefixCache
from services.gpu_worker.memory.prefix_journal import Announcement, PrefixJournal
from services.gpu_worker.memory.unified_pool import UnifiedPool

LAYOUT = PoolLayout(num_pages=8, kv_block_tokens=4, kv_dim=8, num_layers=2)
KEYS = [bytes([i]) * 32 for i in range(4)]


def cache_with(keys: list[bytes], journal: PrefixJournal | None = None) -> tuple[UnifiedPool, PrefixCache]:
    pool = UnifiedPool(PoolView.zeros(LAYOUT, torch.float32))
    cache = PrefixCache(pool, journal=journal)
    for key in keys:
        pages = pool.allocate(LAYOUT.num_layers, PageUse.KV)
        for page in pages:
            pool.buffer[page * LAYOUT.page_elems : (page + 1) * LAYOUT.page_elems] = torch.randn(
                LAYOUT.page_elems
            )
        cache.insert(key, pages)
        cache.release([key])
    return pool, cache


def test_the_journal_sends_the_whole_set_first_then_changes_and_again_after_overflow():
    journal = PrefixJournal(max_pending=3)
    _, cache = cache_with(KEYS[:2], journal)
    assert journal.drain() == Announcement(sorted(KEYS[:2]), [], True)
    assert journal.drain() == Announcement([], [], False) and not journal.pending()
    cache.make_room(LAYOUT.num_pages, PageUse.KV)  # evicts both
    assert journal.drain() == Announcement([], sorted(KEYS[:2]), False)
    for key in KEYS:
        journal.cached(key)
    assert journal.drain() == Announcement(sorted(KEYS), [], True)  # 4 changes > 3: the whole set


def test_exported_blocks_import_byte_for_byte_and_stay_evictable():
    _, source = cache_with(KEYS[:3])
    kv = source.export_blocks([*KEYS[:2], b"missing" * 4, KEYS[2]])
    assert kv.shape == (2, LAYOUT.num_layers, 2 * LAYOUT.kv_block_tokens, LAYOUT.kv_dim)  # leading run

    pool = UnifiedPool(PoolView.zeros(LAYOUT, torch.float32))
    target = PrefixCache(pool)
    assert target.import_blocks(KEYS[:2], kv) == 2
    assert torch.equal(target.export_blocks(KEYS[:2]), kv)
    assert target.stats().evictable_blocks == 2 and target.cached_run(KEYS) == 2
    assert target.import_blocks(KEYS[:2], kv) == 2  # cached already: kept as they are

    full = PrefixCache(pool)  # another cache over the same pages: no room once they are held
    pool.allocate(pool.allocator.free_pages_for(PageUse.KV) - LAYOUT.num_layers, PageUse.KV)
    assert full.import_blocks(KEYS[:2], kv) == 1
