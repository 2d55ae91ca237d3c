"""The device residency under the eviction interface: an LFU policy's order, and pinned adapters
never evicted, their pages not counted as evictable."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.attention.pool_view import PoolLayout, PoolView
from services.gpu_worker.lora.host_adapter import HostAdapter, LoraFactors
from services.gpu_worker.memory.adapter_residency import AdapterResidency
from services.gpu_worker.memory.page_allocator import PageUse, PoolExhausted
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.runtime.eviction import LFUEviction

LAYOUT = PoolLayout(num_pages=64, kv_block_tokens=4, kv_dim=8, num_layers=2)


def adapter(adapter_id: str) -> HostAdapter:
    torch.manual_seed(0)
    modules = {(0, "q_proj"): LoraFactors(torch.randn(4, 24), torch.randn(4, 40), 0.5)}
    return HostAdapter(adapter_id, modules)


def full_residency(eviction=None) -> tuple[AdapterResidency, int]:
    """Adapters a, b, c resident in a pool whose other pages hold KV; the pages of one adapter."""
    pool = UnifiedPool(PoolView.zeros(LAYOUT, torch.float32))
    residency = AdapterResidency(pool, eviction=eviction)
    for name in "abc":
        residency.load(adapter(name))
    pool.allocate(pool.usage().free_pages, PageUse.KV)
    return residency, len(residency.get("a").pages)


def test_lfu_evicts_the_least_used_idle_adapter():
    residency, one = full_residency(LFUEviction())
    for name in ("a", "a", "c"):
        residency.load(adapter(name))  # a resident adapter's load is a use
    residency.make_room(one)
    assert sorted(residency.ids()) == ["a", "c"]  # b, used once, went


def test_a_pinned_adapter_is_never_evicted():
    residency, one = full_residency()
    residency.set_pinned({"a", "b"})
    assert residency.idle_pages() == one  # only c's pages are evictable
    residency.make_room(one)
    assert sorted(residency.ids()) == ["a", "b"]
    with pytest.raises(PoolExhausted):
        residency.make_room(2 * one)  # c's pages are free, the rest is pinned
    residency.set_pinned({"b"})
    residency.make_room(2 * one)
    assert residency.ids() == ["b"]
