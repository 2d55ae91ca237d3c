"""The residency's per-module placement (page bound, runs, touched pages) against the row-by-row
algorithm it replaced: the same pages and the same offsets, on mixed ranks, targets and widths,
in fresh and fragmented pools."""

from __future__ import annotations

import random

import pytest
import torch

from services.gpu_worker.attention.pool_view import PoolLayout, PoolView
from services.gpu_worker.lora.host_adapter import HostAdapter, LoraFactors, with_rows
from services.gpu_worker.memory.adapter_residency import (
    NOT_TARGETED,
    AdapterResidency,
    _pages_upper_bound,
    _regions,
    write_rows,
)
from services.gpu_worker.memory.page_allocator import PageUse
from services.gpu_worker.memory.unified_pool import UnifiedPool

LAYOUT = PoolLayout(num_pages=512, kv_block_tokens=8, kv_dim=8, num_layers=2)  # 128 elements a page
TARGETS = {"q_proj": (24, 24), "k_proj": (24, 8), "v_proj": (24, 8), "o_proj": (24, 24),
           "gate_proj": (24, 56), "up_proj": (24, 56), "down_proj": (56, 24)}  # fmt: skip


def _old_bound(adapter: HostAdapter, page_elems: int) -> int:
    pages, offset = 1, 0
    for factors in adapter.modules.values():
        for width, count in ((factors.a.shape[1], factors.rank), (factors.b_t.shape[1], factors.rank)):
            for _ in range(count):
                if offset + width > page_elems:
                    pages, offset = pages + 1, 0
                offset += width
    return pages


def _old_place(adapter: HostAdapter, pages: list[int], page_elems: int):
    """The row-by-row placement of before: offsets per module and the pages touched."""
    regions = iter(_regions(pages, page_elems))
    region_start, region_len = next(regions)
    used = 0
    touched: set[int] = set()

    def place(width: int, count: int) -> list[int]:
        nonlocal region_start, region_len, used
        offsets = []
        for _ in range(count):
            if used + width > region_len:
                region_start, region_len = next(regions)
                used = 0
            offset = region_start + used
            offsets.append(offset)
            touched.update(range(offset // page_elems, (offset + width - 1) // page_elems + 1))
            used += width
        return offsets

    modules = {}
    for key, factors in adapter.modules.items():
        a = place(factors.a.shape[1], factors.rank)
        b = place(factors.b_t.shape[1], factors.rank)
        modules[key] = (tuple(a), tuple(b))
    return modules, sorted(touched)


def _adapter(rng: random.Random, adapter_id: str) -> HostAdapter:
    targets = rng.choice([("q_proj", "v_proj"), tuple(TARGETS), ("down_proj", "k_proj", "gate_proj")])
    modules = {}
    for layer in range(rng.randint(1, 3)):
        for name in targets:
            rank = rng.choice([1, 2, 3, 5, 8, 13])  # rank_pattern: ranks differ by module
            width_in, width_out = TARGETS[name]
            modules[(layer, name)] = LoraFactors(
                torch.randn(rank, width_in), torch.randn(rank, width_out), 0.5
            )
    return HostAdapter(adapter_id, modules)


@pytest.mark.parametrize("seed", range(6))
def test_placements_equal_the_row_by_row_algorithm(seed):
    rng = random.Random(seed)
    pool = UnifiedPool(PoolView.zeros(LAYOUT, torch.float32))
    if seed % 2:  # fragment the pool: KV holds a random half of the pages
        taken = pool.allocate(LAYOUT.num_pages, PageUse.KV)
        pool.free(rng.sample(taken, LAYOUT.num_pages // 2))
    residency = AdapterResidency(pool)
    for i in range(4):
        host = _adapter(rng, f"a{i}")
        assert _pages_upper_bound(host, LAYOUT.page_elems) == _old_bound(host, LAYOUT.page_elems)
        free_before = pool.allocator.free_pages_for(PageUse.ADAPTER)
        # The pages the new load allocates are the ones the old one would have: peek at them.
        needed = _old_bound(host, LAYOUT.page_elems)
        peek = pool.allocate(needed, PageUse.ADAPTER)
        pool.free(peek)
        expected_modules, expected_pages = _old_place(host, peek, LAYOUT.page_elems)
        resident = residency.load(host)
        assert resident.pages == expected_pages
        assert pool.allocator.free_pages_for(PageUse.ADAPTER) == free_before - len(expected_pages)
        for key, (a, b) in expected_modules.items():
            placed = resident.modules[key]
            assert placed.a_offsets == a and placed.b_offsets == b
            assert tuple(placed.rows.a_offsets.tolist()) == a and tuple(placed.rows.b_offsets.tolist()) == b
            width_a, width_b = host.modules[key].a.shape[1], host.modules[key].b_t.shape[1]
            assert placed.rows.runs("a", width_a) == tuple(placed.a_runs)
            rows = placed.rows
            rows._runs.clear()  # what runs() finds from the offsets is what the placement gave
            assert rows.runs("a", width_a) == placed.a_runs and rows.runs("b", width_b) == placed.b_runs
        for key, factors in host.modules.items():  # and the rows are where it says
            placed = resident.modules[key]
            a = torch.stack([pool.buffer[o : o + factors.a.shape[1]] for o in placed.a_offsets])
            assert torch.equal(a, factors.a)


def test_offsets_are_built_on_first_use_not_at_load():
    pool = UnifiedPool(PoolView.zeros(LAYOUT, torch.float32))
    written = []
    residency = AdapterResidency(pool, write=lambda adapter, resident: written.append(resident))
    host = _adapter(random.Random(1), "a")
    resident = residency.load(host)
    assert resident._modules is None  # the engine thread computed runs only
    write_rows(pool.buffer, host, written[0])  # the copier's write builds them
    assert resident._modules is not None and set(resident.modules) == set(host.modules)


@pytest.mark.parametrize("fragmented", [False, True])
def test_an_adapter_is_written_in_one_copy_per_region_of_pages_and_every_row_lands(fragmented):
    rng = random.Random(7)
    pool = UnifiedPool(PoolView.zeros(LAYOUT, torch.float32))
    if fragmented:  # every other page taken: no adapter fits one run of pages
        taken = pool.allocate(LAYOUT.num_pages, PageUse.KV)
        pool.free(taken[::2])
    residency = AdapterResidency(pool)
    for i in range(3):
        host = with_rows(_adapter(rng, f"a{i}"), torch.float32)
        resident = residency.load(host)
        assert (len(resident.row_chunks) > 1) == fragmented
        assert sum(length for _, length in resident.row_chunks) == host.rows.numel()
        for key, factors in host.modules.items():
            placed = resident.modules[key]
            for matrix, offsets in ((factors.a, placed.a_offsets), (factors.b_t, placed.b_offsets)):
                width = matrix.shape[1]
                assert torch.equal(torch.stack([pool.buffer[o : o + width] for o in offsets]), matrix)


def test_a_projection_with_one_rank_in_every_layer_has_its_offsets_gathered_by_layer():
    """What the step builder gathers all layers' offsets of a projection from, in one cat."""
    pool = UnifiedPool(PoolView.zeros(LAYOUT, torch.float32))
    residency = AdapterResidency(pool)
    modules = {}
    for layer in range(3):
        modules[(layer, "q_proj")] = LoraFactors(torch.randn(4, 16), torch.randn(4, 16), 0.5)
        modules[(layer, "v_proj")] = LoraFactors(torch.randn(2 + layer, 16), torch.randn(2 + layer, 8), 0.5)
    modules[(1, "k_proj")] = LoraFactors(torch.randn(4, 16), torch.randn(4, 8), 0.5)  # layers_to_transform
    resident = residency.load(HostAdapter("a", modules))
    assert resident.signature("q_proj", 3) == (4, 0.5)
    assert resident.signature("v_proj", 3) is None  # ranks differ by layer (rank_pattern)
    assert resident.signature("k_proj", 3) is None  # one layer only
    assert resident.signature("up_proj", 3) is NOT_TARGETED
    a, b = resident.layer_offsets("q_proj", 3)
    assert a.shape == b.shape == (3, 4)
    for layer in range(3):
        rows = resident.modules[(layer, "q_proj")].rows
        assert torch.equal(a[layer], rows.a_offsets) and torch.equal(b[layer], rows.b_offsets)
