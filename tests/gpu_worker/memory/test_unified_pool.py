"""The unified pool alone: page accounting, KV addressing, adapter packing and residency."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.attention.pool_view import PoolLayout, PoolView
from services.gpu_worker.lora.host_adapter import HostAdapter, LoraFactors
from services.gpu_worker.memory.adapter_residency import AdapterResidency
from services.gpu_worker.memory.kv_cache import KvTable
from services.gpu_worker.memory.page_allocator import PageAllocator, PageUse, PoolExhausted
from services.gpu_worker.memory.unified_pool import UnifiedPool

LAYOUT = PoolLayout(num_pages=64, kv_block_tokens=4, kv_dim=8, num_layers=2)  # 64 elements a page


def adapter(
    adapter_id: str, rank: int, width_in: int = 24, width_out: int = 40, layers: int = 2
) -> HostAdapter:
    torch.manual_seed(rank)
    modules = {
        (layer, name): LoraFactors(torch.randn(rank, width_in), torch.randn(rank, width_out), 0.5)
        for layer in range(layers)
        for name in ("q_proj", "down_proj")
    }
    return HostAdapter(adapter_id, modules)


def test_allocation_is_all_or_nothing_and_accounted_by_use():
    allocator = PageAllocator(10)
    kv = allocator.allocate(4, PageUse.KV)
    allocator.allocate(3, PageUse.ADAPTER)
    with pytest.raises(PoolExhausted):
        allocator.allocate(4, PageUse.KV)
    usage = allocator.usage()
    assert (usage.free_pages, usage.kv_pages, usage.adapter_pages) == (3, 4, 3)
    allocator.free(kv)
    assert allocator.usage().free_pages == 7
    with pytest.raises(ValueError):
        allocator.free(kv)


def test_a_refused_free_changes_nothing_and_pages_come_back_lowest_first():
    allocator = PageAllocator(8)
    pages = allocator.allocate(5, PageUse.ADAPTER)
    assert pages == [0, 1, 2, 3, 4]
    for wrong in ([pages[0], 7], [pages[1], pages[1]]):  # one never allocated; one listed twice
        with pytest.raises(ValueError):
            allocator.free(wrong)
        assert allocator.usage().adapter_pages == 5 and allocator.free_pages == 3
    allocator.free(list(reversed(pages)))
    assert allocator.allocate(2, PageUse.KV) == [0, 1]
    assert (allocator.usage().kv_pages, allocator.usage().adapter_pages) == (2, 0)


def test_kv_rows_address_one_layer_block_per_page():
    pool = UnifiedPool(PoolView.zeros(LAYOUT, torch.float32))
    table = KvTable(pool)
    table.reserve(9)  # 3 blocks of 4 tokens x 2 layers
    assert len(table.blocks) == 3 and pool.usage().kv_pages == 6 and table.capacity == 12
    keys, values = table.rows(torch.arange(9))
    assert keys.shape == (9, 2)
    # Every (token, layer) has its own key row and value row, all distinct, inside its page.
    every = torch.cat([keys.flatten(), values.flatten()])
    assert every.unique().numel() == every.numel()
    rows_per_page = LAYOUT.page_elems // LAYOUT.kv_dim
    pages = torch.tensor(table.blocks)[torch.arange(9) // 4]
    assert torch.equal(keys // rows_per_page, pages) and torch.equal(values // rows_per_page, pages)
    table.release()
    assert pool.usage().free_pages == 64


def test_adapter_rows_in_the_pool_equal_its_factors_and_are_contiguous():
    pool = UnifiedPool(PoolView.zeros(LAYOUT, torch.float32))
    residency = AdapterResidency(pool)
    host = adapter("a", rank=5)
    resident = residency.load(host)
    for key, factors in host.modules.items():
        rows = resident.modules[key].rows
        a = torch.stack([pool.buffer[o : o + 24] for o in rows.a_offsets.tolist()])
        b = torch.stack([pool.buffer[o : o + 40] for o in rows.b_offsets.tolist()])
        assert torch.equal(a, factors.a) and torch.equal(b, factors.b_t)
        assert rows.runs("a", 24) == ((rows.a_offsets[0].item(), 5),)  # one strided view
    used = sum(f.a.numel() + f.b_t.numel() for f in host.modules.values())
    assert len(resident.pages) == -(-used // LAYOUT.page_elems)  # no page wasted in a fresh pool
    assert pool.usage().adapter_pages == len(resident.pages)


def test_rows_never_cross_into_a_non_adjacent_page():
    pool = UnifiedPool(PoolView.zeros(LAYOUT, torch.float32))
    taken = pool.allocate(64, PageUse.KV)
    pool.free(taken[::2])  # only every other page is free: no two free pages are adjacent
    residency = AdapterResidency(pool)
    host = adapter("a", rank=2, layers=1)
    resident = residency.load(host)
    for key, factors in host.modules.items():
        rows = resident.modules[key].rows
        for offset, width in [(o, 24) for o in rows.a_offsets.tolist()] + [
            (o, 40) for o in rows.b_offsets.tolist()
        ]:
            assert offset // 64 == (offset + width - 1) // 64
        a = torch.stack([pool.buffer[o : o + 24] for o in rows.a_offsets.tolist()])
        assert torch.equal(a, factors.a)


def test_only_idle_adapters_are_evicted_lru():
    pool = UnifiedPool(PoolView.zeros(LAYOUT, torch.float32))
    residency = AdapterResidency(pool)
    for name in "abc":
        residency.load(adapter(name, rank=4))
    residency.acquire("a")
    per_adapter = len(residency.get("b").pages)
    pool.allocate(pool.usage().free_pages, PageUse.KV)
    residency.make_room(per_adapter)
    assert residency.ids() == ["c", "a"]  # b, the least recently used idle one, went; a is in use
    with pytest.raises(PoolExhausted):
        residency.make_room(10 * per_adapter)
    with pytest.raises(RuntimeError):
        residency.evict("a")
    residency.release("a")
    residency.evict("a")
    assert residency.ids() == ["c"]


def test_split_allocator_keeps_kv_and_adapter_regions_apart():
    allocator = PageAllocator(10, adapter_region_pages=4)
    assert not allocator.unified
    assert (allocator.free_pages_for(PageUse.KV), allocator.free_pages_for(PageUse.ADAPTER)) == (6, 4)
    adapter_pages = allocator.allocate(4, PageUse.ADAPTER)
    assert sorted(adapter_pages) == [6, 7, 8, 9]
    with pytest.raises(PoolExhausted):
        allocator.allocate(1, PageUse.ADAPTER)  # 6 KV pages are free, but not for adapters
    kv = allocator.allocate(6, PageUse.KV)
    assert max(kv) < 6 and allocator.free_pages == 0
    allocator.free(adapter_pages)
    with pytest.raises(PoolExhausted):
        allocator.allocate(1, PageUse.KV)
    assert allocator.usage().free_pages == 4
    with pytest.raises(ValueError, match="adapter_region_pages"):
        PageAllocator(10, adapter_region_pages=10)


def test_split_pool_does_not_evict_adapters_for_kv():
    pool = UnifiedPool(PoolView.zeros(LAYOUT, torch.float32), 32)
    residency = AdapterResidency(pool)
    residency.load(adapter("idle", rank=4))
    pool.allocate(pool.allocator.free_pages_for(PageUse.KV), PageUse.KV)
    with pytest.raises(PoolExhausted):
        residency.make_room(1, PageUse.KV)
    assert "idle" in residency  # evicting it would not have freed a KV page
    residency.make_room(pool.allocator.free_pages_for(PageUse.ADAPTER) + 1)
    assert "idle" not in residency  # but it makes room for another adapter


def test_a_reloaded_adapter_gets_a_new_placement_even_on_the_same_pages():
    # The step builder reuses a step's LoRA segments while every (adapter, placement) is unchanged;
    # a reload must look different even when the allocator hands back the very same pages.
    pool = UnifiedPool(PoolView.zeros(LAYOUT, torch.float32))
    residency = AdapterResidency(pool)
    first = residency.load(adapter("a", rank=4))
    assert residency.load(adapter("a", rank=4)) is first  # resident: the same placement
    residency.evict("a")
    second = residency.load(adapter("a", rank=4))
    assert second.pages == first.pages
    assert second.placement != first.placement
