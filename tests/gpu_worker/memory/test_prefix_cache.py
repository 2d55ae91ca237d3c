"""The prefix cache alone: chain keys per key space and namespace, reference counts, LRU eviction
under the unified pool's pressure (before idle adapters), and KV tables holding shared blocks."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.attention.pool_view import PoolLayout, PoolView
from services.gpu_worker.distkv.kv_block_allocator import KvRows
from services.gpu_worker.distkv.local_block_allocator import LocalBlockAllocator
from services.gpu_worker.memory.adapter_residency import AdapterResidency
from services.gpu_worker.memory.kv_cache import KvTable
from services.gpu_worker.memory.page_allocator import PageUse, PoolExhausted
from services.gpu_worker.memory.prefix_cache import (
    BASE_MODEL_KEY_SPACE,
    PrefixCache,
    adapter_key_space,
    block_keys,
    namespaced_key_space,
)
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.runtime.errors import FailedPrecondition
from tests.gpu_worker.memory.test_unified_pool import adapter

LAYOUT = PoolLayout(num_pages=16, kv_block_tokens=4, kv_dim=8, num_layers=2)


def computed_table(pool: UnifiedPool, cache: PrefixCache, keys: list[bytes]) -> KvTable:
    """A request's table whose blocks were computed and handed to the cache."""
    table = KvTable(pool, cache)
    table.reserve(len(keys) * LAYOUT.kv_block_tokens)
    for index, key in enumerate(keys):
        assert cache.insert(key, table.blocks[index])
        table.share(index, key)
    return table


def test_keys_are_chained_whole_blocks_and_differ_by_key_space():
    tokens = list(range(10))
    keys = block_keys(BASE_MODEL_KEY_SPACE, tokens, 4)
    assert len(keys) == 2  # the partial third block has no key
    assert block_keys(BASE_MODEL_KEY_SPACE, [99, *tokens[1:]], 4)[1] != keys[1]  # the chain
    assert block_keys(BASE_MODEL_KEY_SPACE, tokens[:8], 4) == keys
    v1, v2 = adapter_key_space("a", "sha-1"), adapter_key_space("a", "sha-2")
    spaces = [BASE_MODEL_KEY_SPACE, v1, v2, adapter_key_space("b", "sha-1")]
    firsts = {block_keys(space, tokens, 4)[0] for space in spaces}
    assert len(firsts) == len(spaces)


def test_a_namespace_salts_every_block_and_one_namespace_shares():
    tokens = list(range(12))
    spaces = [BASE_MODEL_KEY_SPACE, adapter_key_space("a", "sha-1")]
    for space in spaces:
        alice, bob = (
            block_keys(namespaced_key_space(space, f"tenant:{t}"), tokens, 4) for t in ("alice", "bob")
        )
        assert not set(alice) & set(bob)  # the salt in the first key changes every key after it
        salted = [block_keys(namespaced_key_space(space, "salt:s3cret"), tokens, 4) for _ in range(2)]
        assert salted[0] == salted[1] and not set(salted[0]) & set(alice)
        assert block_keys(namespaced_key_space(space, ""), tokens, 4) == block_keys(space, tokens, 4)
    firsts = {
        block_keys(namespaced_key_space(space, namespace), tokens, 4)[0]
        for space in spaces
        for namespace in ("tenant:alice", "salt:alice", "tenant:bob", "")
    }
    assert len(firsts) == 8


def test_shared_blocks_are_reference_counted_and_stay_cached_when_unused():
    pool = UnifiedPool(PoolView.zeros(LAYOUT, torch.float32))
    cache = PrefixCache(pool)
    keys = block_keys(BASE_MODEL_KEY_SPACE, list(range(8)), 4)
    first = computed_table(pool, cache, keys)
    second = KvTable(pool, cache)
    second.attach_cached(keys, cache.acquire_prefix(keys, looked_up=2))
    assert second.blocks == first.blocks and [cache.refcount(k) for k in keys] == [2, 2]
    second.reserve(9)  # one block of its own after the shared ones
    first.release()
    second.release()
    assert [cache.refcount(k) for k in keys] == [0, 0]
    stats = cache.stats()
    assert (stats.cached_blocks, stats.evictable_blocks, stats.hit_blocks) == (2, 2, 2)
    assert pool.usage().kv_pages == 4  # the cached blocks' pages, nothing else
    assert cache.insert(keys[0], [0, 1]) is False  # cached already: the caller keeps its block


def test_the_lookup_stops_at_the_first_uncached_block():
    pool = UnifiedPool(PoolView.zeros(LAYOUT, torch.float32))
    cache = PrefixCache(pool)
    keys = block_keys(BASE_MODEL_KEY_SPACE, list(range(12)), 4)
    computed_table(pool, cache, [keys[0]]).release()
    assert len(cache.acquire_prefix(keys, looked_up=3)) == 1
    assert (cache.stats().hit_blocks, cache.stats().missed_blocks) == (1, 2)


def test_pool_pressure_evicts_unused_cached_blocks_lru_before_idle_adapters():
    pool = UnifiedPool(PoolView.zeros(LAYOUT, torch.float32))
    cache = PrefixCache(pool)
    residency = AdapterResidency(pool, prefix_cache=cache)
    residency.load(adapter("a", rank=2))  # idle adapter: its pages are evictable too
    old = block_keys(BASE_MODEL_KEY_SPACE, [1] * 8, 4)
    new = block_keys(BASE_MODEL_KEY_SPACE, [2] * 8, 4)
    computed_table(pool, cache, old).release()
    computed_table(pool, cache, new).release()
    held = KvTable(pool, cache)
    held.attach_cached(new[:1], cache.acquire_prefix(new[:1], looked_up=1))  # in use: stays
    wanted = pool.allocator.free_pages + 2 * LAYOUT.num_layers
    residency.make_room(wanted, PageUse.KV)
    # The old chain went first, from its tail; the adapter and the used block stayed.
    assert old[0] not in cache and old[1] not in cache and new[0] in cache
    assert "a" in residency
    residency.make_room(pool.allocator.free_pages + 2 * LAYOUT.num_layers, PageUse.KV)
    assert new[1] not in cache and new[0] in cache and "a" not in residency
    with pytest.raises(PoolExhausted):  # the used block is never evicted
        residency.make_room(LAYOUT.num_pages, PageUse.KV)
    held.release()
    assert cache.refcount(new[0]) == 0 and cache.stats().evicted_blocks == 3


def test_a_table_handing_over_shared_blocks_keeps_their_references_and_the_new_owner_frees_only_its_own():
    """A request that starts to borrow hands its pages to the rManager; its cached prompt blocks
    stay the cache's: read-only there, forgotten (not freed) when the request ends, and released
    to the cache by its KV table."""
    pool = UnifiedPool(PoolView.zeros(LAYOUT, torch.float32))
    cache = PrefixCache(pool)
    keys = block_keys(BASE_MODEL_KEY_SPACE, list(range(8)), 4)
    table = computed_table(pool, cache, keys)
    table.reserve(12)  # a third block of its own
    local = LocalBlockAllocator(pool)
    cached = set(table.shared)
    blocks = local.adopt(table.hand_over(), cached)
    assert cached == {0, 1} and len(blocks) == 3 and local.allocated_blocks == 1
    ones = torch.ones(1, LAYOUT.kv_dim)
    with pytest.raises(FailedPrecondition, match="read-only"):
        local.write(0, KvRows(blocks[:1], torch.tensor([0]), ones, ones))
    assert all(cache.refcount(key) == 1 for key in keys)
    free_before = pool.usage().free_pages
    local.free(blocks)
    assert pool.usage().free_pages == free_before + LAYOUT.num_layers  # its own block only
    table.release()
    assert all(cache.refcount(key) == 0 for key in keys) and cache.evictable_pages() == 2 * LAYOUT.num_layers
