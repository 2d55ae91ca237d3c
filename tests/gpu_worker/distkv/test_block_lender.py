"""The creditor side: lending up to a cap, ownership checks on every call, reclaiming a dead
debtor's blocks, and exact accounting through all of it."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.attention.dist_attention import micro_attention
from services.gpu_worker.attention.pool_view import PoolLayout, PoolView
from services.gpu_worker.distkv.block_lender import BlockLender, LendingConfig, NotLent
from services.gpu_worker.distkv.kv_block_allocator import AttendCall, AttendSegment, KvRows
from services.gpu_worker.distkv.local_block_allocator import LocalBlockAllocator
from services.gpu_worker.memory.page_allocator import PageUse, PoolExhausted
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.runtime.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted

BLOCK, KV_HEADS, HEAD_DIM, HEADS, LAYERS = 4, 2, 8, 4, 2
LAYOUT = PoolLayout(num_pages=20, kv_block_tokens=BLOCK, kv_dim=KV_HEADS * HEAD_DIM, num_layers=LAYERS)


def lender(cap: int = 6, dtype: torch.dtype = torch.float32) -> BlockLender:
    return BlockLender(
        LocalBlockAllocator(UnifiedPool(PoolView.zeros(LAYOUT, dtype))), LendingConfig(max_lent_blocks=cap)
    )


def kv_rows(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, LAYOUT.kv_dim, generator=generator), torch.randn(
        n, LAYOUT.kv_dim, generator=generator
    )


def test_lends_up_to_the_cap_and_refuses_past_it_naming_the_cap():
    creditor = lender(cap=6)
    first = creditor.allocate("a", 4)
    assert len(set(first)) == 4 and creditor.lent_blocks == 4
    with pytest.raises(ResourceExhausted, match="cap of 6 blocks"):
        creditor.allocate("b", 3)
    # The refusal changed nothing; what still fits under the cap is lent.
    assert creditor.lent_to() == {"a": 4} and creditor.local.allocated_blocks == 4
    creditor.allocate("b", 2)
    assert creditor.lent_to() == {"a": 4, "b": 2}


def test_a_full_pool_refuses_instead_of_borrowing():
    creditor = lender(cap=100)
    creditor.local.allocate(8)  # 16 of 20 pages used locally: room for 2 blocks
    with pytest.raises(ResourceExhausted, match="no room for 3 blocks"):
        creditor.allocate("a", 3)
    assert creditor.lent_blocks == 0
    assert len(creditor.allocate("a", 2)) == 2


def test_bad_requests_get_clear_errors_and_change_nothing():
    creditor = lender()
    mine = creditor.allocate("a", 2)
    theirs = creditor.allocate("b", 1)
    keys, values = kv_rows(1)
    slots = torch.tensor([0])
    with pytest.raises(PermissionDenied, match=f"block {theirs[0]} is not lent to a"):
        creditor.write("a", 0, KvRows(theirs, slots, keys, values))
    with pytest.raises(PermissionDenied):
        creditor.free("a", [mine[0], theirs[0]])
    query = AttendSegment(torch.randn(1, HEADS, HEAD_DIM), torch.tensor([0]), theirs, [0])
    with pytest.raises(PermissionDenied):
        creditor.attend("a", AttendCall(0, [query]))
    with pytest.raises(PermissionDenied):
        creditor.read("a", theirs)
    with pytest.raises(NotLent, match="never lent"):
        creditor.write("a", 0, KvRows([99], slots, keys, values))
    with pytest.raises(InvalidArgument, match="layer 2"):
        creditor.write("a", 2, KvRows(mine[:1], slots, keys, values))
    with pytest.raises(InvalidArgument, match="slots"):
        creditor.write("a", 0, KvRows(mine[:1], torch.tensor([BLOCK]), keys, values))
    with pytest.raises(InvalidArgument, match="keys must be"):
        creditor.write("a", 0, KvRows(mine, torch.tensor([0, 1]), keys, values))
    with pytest.raises(InvalidArgument, match="twice"):
        creditor.free("a", [mine[0], mine[0]])
    with pytest.raises(InvalidArgument, match="at least one block"):
        creditor.allocate("a", 0)
    # Nothing above freed or moved a block; the failed free of a mixed list freed none.
    assert creditor.lent_to() == {"a": 2, "b": 1} and creditor.local.allocated_blocks == 3


def test_freed_blocks_are_reported_as_freed_and_never_reused():
    creditor = lender()
    ids = creditor.allocate("a", 2)
    creditor.free("a", ids[:1])
    keys, values = kv_rows(1)
    with pytest.raises(NotLent, match=f"block {ids[0]} was freed"):
        creditor.write("a", 0, KvRows(ids[:1], torch.tensor([0]), keys, values))
    with pytest.raises(NotLent, match="was freed"):
        creditor.free("a", ids[:1])  # double free
    again = creditor.allocate("b", 1)
    assert again[0] not in ids  # the page is reused, the id is not: a stale id never aliases b's block
    with pytest.raises(NotLent):
        creditor.write("a", 0, KvRows(ids[:1], torch.tensor([0]), keys, values))
    assert creditor.lent_to() == {"a": 1, "b": 1}


def test_reclaiming_a_dead_debtor_frees_exactly_its_blocks():
    creditor = lender(cap=8)
    pool = creditor.local.pool
    creditor.allocate("a", 3)
    kept = creditor.allocate("b", 2)
    creditor.allocate("a", 1)
    assert pool.usage().kv_pages == 6 * LAYERS
    assert creditor.reclaim("a") == 4
    assert creditor.reclaim("a") == 0  # idempotent
    assert creditor.lent_to() == {"b": 2} and creditor.blocks_of("b") == kept
    assert pool.usage().kv_pages == 2 * LAYERS and pool.usage().free_pages == LAYOUT.num_pages - 2 * LAYERS
    creditor.free("b", kept)
    assert pool.usage().free_pages == LAYOUT.num_pages and creditor.local.allocated_blocks == 0


def test_attention_over_a_debtors_blocks_only():
    """What a creditor runs on an incoming query: the partial over the blocks it holds for that
    debtor equals micro-attention over exactly those tokens."""
    creditor = lender()
    ids = creditor.allocate("a", 2)  # the debtor's logical blocks 1 and 3: positions 4..7, 12..15
    other = creditor.allocate("b", 1)
    firsts = [4, 12]
    for layer in range(LAYERS):
        keys, values = kv_rows(2 * BLOCK, seed=layer)
        both = [ids[0]] * BLOCK + [ids[1]] * BLOCK
        creditor.write("a", layer, KvRows(both, torch.arange(2 * BLOCK) % BLOCK, keys, values))
        creditor.write("b", layer, KvRows(other * BLOCK, torch.arange(BLOCK), *kv_rows(BLOCK, seed=9)))
    queries = torch.randn(3, HEADS, HEAD_DIM)
    positions = torch.tensor([5, 13, 20])
    (partial,) = creditor.attend("a", AttendCall(1, [AttendSegment(queries, positions, ids, firsts)]))
    keys, values = kv_rows(2 * BLOCK, seed=1)
    expected = micro_attention(
        queries, keys.view(-1, KV_HEADS, HEAD_DIM), values.view(-1, KV_HEADS, HEAD_DIM), positions,
        torch.tensor([4, 5, 6, 7, 12, 13, 14, 15]),
    )  # fmt: skip
    assert torch.allclose(partial.output, expected.output, atol=1e-6)
    assert torch.allclose(partial.lse, expected.lse, atol=1e-6)
    with pytest.raises(InvalidArgument, match="queries must be"):
        creditor.attend(
            "a", AttendCall(0, [AttendSegment(torch.randn(3, 5, HEAD_DIM), positions, ids, firsts)])
        )


def test_a_bf16_pool_stores_bf16_and_attends_in_fp32():
    creditor = lender(dtype=torch.bfloat16)
    ids = creditor.allocate("a", 1)
    keys, values = kv_rows(BLOCK, seed=3)
    creditor.write("a", 0, KvRows(ids * BLOCK, torch.arange(BLOCK), keys, values))
    queries, positions = torch.randn(2, HEADS, HEAD_DIM), torch.tensor([1, 3])
    (partial,) = creditor.attend("a", AttendCall(0, [AttendSegment(queries, positions, ids, [0])]))
    stored = [rows.to(torch.bfloat16).float().view(BLOCK, KV_HEADS, HEAD_DIM) for rows in (keys, values)]
    expected = micro_attention(queries, *stored, positions, torch.arange(BLOCK))
    assert partial.output.dtype == torch.float32
    assert torch.allclose(partial.output, expected.output, atol=1e-6)


def test_local_allocator_frees_all_or_nothing():
    local = LocalBlockAllocator(UnifiedPool(PoolView.zeros(LAYOUT, torch.float32)))
    blocks = local.allocate(3)
    assert all(len(b.pages) == LAYERS for b in blocks) and local.free_blocks == 7
    with pytest.raises(PoolExhausted):
        local.allocate(8)
    local.free(blocks[:1])
    with pytest.raises(FailedPrecondition, match="not allocated"):
        local.free(blocks)  # blocks[0] is freed already: nothing is freed
    assert local.allocated_blocks == 2 and local.pool.usage().kv_pages == 2 * LAYERS
    with pytest.raises(FailedPrecondition, match="twice"):
        local.free([blocks[1], blocks[1]])
    local.free(blocks[1:])
    assert local.pool.usage().free_pages == LAYOUT.num_pages
    # Adapter pages share the pool: free blocks count what KV could take now.
    local.pool.allocate(5, PageUse.ADAPTER)
    assert local.free_blocks == 7


def test_a_lender_started_later_numbers_its_loans_above_every_id_of_the_one_before():
    """A worker restarted under the same id must never lend an id its predecessor lent: the
    debtor's stale id would name another loan's KV."""
    before = lender()
    old = before.allocate("a", 3) + before.allocate("b", 2)
    after = lender()
    assert min(after.allocate("a", 3)) > max(old)
    with pytest.raises(NotLent, match="never lent by this worker process"):
        after.free("a", old[:1])
