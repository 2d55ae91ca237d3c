"""Prefill write planning: which token ranges of a prompt go to which local or creditor block."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.gpu_worker.memory.block_table import RemoteBlock
from services.gpu_worker.memory.prefill_plan import RemoteGrant, plan_prefill
from services.runtime.errors import InvalidArgument, ResourceExhausted


def test_local_first_then_grants_in_order_with_the_surplus_given_back():
    grants = [RemoteGrant("w1", (7, 8)), RemoteGrant("w2", (0, 1, 2))]
    plan = plan_prefill(prompt_len=21, block_tokens=4, free_local_blocks=2, grants=grants)
    assert plan.local_blocks == 2
    assert [(b.token_start, b.token_end, b.remote) for b in plan.blocks] == [
        (0, 4, None),
        (4, 8, None),
        (8, 12, RemoteBlock("w1", 7)),
        (12, 16, RemoteBlock("w1", 8)),
        (16, 20, RemoteBlock("w2", 0)),
        (20, 21, RemoteBlock("w2", 1)),
    ]
    assert plan.surplus == (RemoteGrant("w2", (2,)),)
    assert [(b.index, b.token_start) for b in plan.ranges_on("w1")] == [(2, 8), (3, 12)]


def test_a_prompt_that_fits_locally_needs_no_grant():
    plan = plan_prefill(16, 4, free_local_blocks=10, grants=[RemoteGrant("w1", (3,))])
    assert plan.local_blocks == 4 and all(b.remote is None for b in plan.blocks)
    assert plan.surplus == (RemoteGrant("w1", (3,)),)
    assert plan_prefill(0, 4, 0, []).blocks == ()


def test_too_little_room_or_bad_grants_are_refused():
    with pytest.raises(ResourceExhausted, match="needs 5 blocks of 4; 2 local and 2 granted"):
        plan_prefill(17, 4, 2, [RemoteGrant("w1", (0, 1))])
    with pytest.raises(InvalidArgument, match="granted twice"):
        plan_prefill(8, 4, 0, [RemoteGrant("w1", (0,)), RemoteGrant("w1", (0,))])
    with pytest.raises(InvalidArgument):
        plan_prefill(8, 0, 1, [])


@given(
    prompt_len=st.integers(0, 200),
    block_tokens=st.integers(1, 16),
    free_local=st.integers(0, 20),
    grant_sizes=st.lists(st.integers(0, 6), max_size=4),
)
def test_every_token_is_placed_once_and_every_grant_used_or_returned(
    prompt_len, block_tokens, free_local, grant_sizes
):
    grants = [RemoteGrant(f"w{i}", tuple(range(10 * i, 10 * i + n))) for i, n in enumerate(grant_sizes)]
    try:
        plan = plan_prefill(prompt_len, block_tokens, free_local, grants)
    except ResourceExhausted:
        assert free_local + sum(grant_sizes) < -(-prompt_len // block_tokens)
        return
    covered = [t for b in plan.blocks for t in range(b.token_start, b.token_end)]
    assert covered == list(range(prompt_len))
    assert all(b.token_end - b.token_start <= block_tokens and b.token_start == b.index * block_tokens
               for b in plan.blocks)  # fmt: skip
    used = [b.remote for b in plan.blocks if b.remote is not None]
    returned = [RemoteBlock(g.creditor, i) for g in plan.surplus for i in g.block_ids]
    granted = [RemoteBlock(g.creditor, i) for g in grants for i in g.block_ids]
    assert sorted(used + returned, key=str) == sorted(granted, key=str)
    assert plan.local_blocks == sum(b.remote is None for b in plan.blocks) <= free_local
