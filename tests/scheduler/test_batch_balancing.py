"""Batch balancing: running requests move from the largest batches to the smallest when the step
model says it pays, never when batches are even, never into a full or memory-short replica."""

from __future__ import annotations

import pytest

from services.scheduler.policies import make_migration
from services.scheduler.policies.batch_balancing import BatchBalancing, BatchBalancingConfig
from services.scheduler.policies.replica_load import ClusterLoad, Migration, ReplicaLoad, RequestLoad


def replica(worker_id, running=0, queued=0, remaining=200, context=50, free_tokens=100_000, max_running=32,
            adapters=None, resident=()) -> ReplicaLoad:  # fmt: skip
    """``running`` running requests ``{worker_id}-r{i}`` (adapter ``adapters[i]``, default one
    adapter each) and ``queued`` queued ones."""
    names = adapters or [f"{worker_id}-a{i}" for i in range(running)]
    requests = tuple(
        RequestLoad(f"{worker_id}-r{i}", names[i], remaining, context, True) for i in range(running)
    )
    requests += tuple(RequestLoad(f"{worker_id}-q{i}", "q", remaining, context) for i in range(queued))
    return ReplicaLoad(worker_id, requests, resident_adapters=frozenset(resident), memory_tokens=100_000,
                       free_tokens=free_tokens, max_running=max_running)  # fmt: skip


def plan(*replicas: ReplicaLoad, **config) -> list[Migration]:
    return BatchBalancing(BatchBalancingConfig(**config)).plan(ClusterLoad(replicas))


def test_a_running_request_moves_from_the_largest_batch_to_the_smallest():
    moves = plan(
        replica("big", running=12), replica("mid", running=6), replica("small", running=2), max_moves=1
    )
    assert moves == [Migration("big-r0", "big-a0", "big", "small")]


def test_moves_continue_until_the_batches_are_within_the_gap():
    moves = plan(replica("big", running=12), replica("small", running=0))
    assert [(m.source, m.target) for m in moves] == [("big", "small")] * 5  # 12/0 -> 7/5: gap 2 < 4
    assert len({m.request_id for m in moves}) == 5
    assert len(plan(replica("big", running=12), replica("small", running=0), min_gap=2)) == 6  # 6/6


def test_nothing_moves_when_the_batches_are_even():
    assert plan(replica("w1", running=10), replica("w2", running=7), replica("w3", running=9)) == []
    assert plan(replica("w1", running=10)) == []
    assert plan() == []


def test_a_request_about_to_finish_is_not_moved():
    # One token left: its recompute stalls the target's batch longer than the move saves.
    assert plan(replica("big", running=12, remaining=1), replica("small", running=0)) == []


def test_a_target_without_free_memory_or_free_slots_receives_nothing():
    big = replica("big", running=12)
    assert plan(big, replica("small", running=2, free_tokens=249)) == []  # 50 context + 200 to grow
    assert len(plan(big, replica("small", running=2, free_tokens=250), max_moves=1)) == 1
    assert plan(big, replica("small", running=2, queued=6, max_running=8)) == []  # its queue takes the slots
    assert len(plan(big, replica("small", running=2, queued=5, max_running=8), max_moves=1)) == 1


def test_prefers_a_request_whose_adapter_the_target_holds_and_runs():
    big = replica("big", running=12, adapters=[f"a{i}" for i in range(12)])
    small = replica("small", running=1, adapters=["a7"], resident={"a7"})
    assert plan(big, small, max_moves=1) == [Migration("big-r7", "a7", "big", "small")]


def test_a_request_sharing_its_adapter_costs_the_source_less_to_keep():
    # Leaving a batch where its adapter stays saves only its token, not the adapter's share: the
    # request alone with its adapter goes first.
    big = replica("big", running=12, adapters=["x", "x", *[f"a{i}" for i in range(10)]])
    moves = plan(big, replica("small", running=0), max_moves=1)
    assert moves[0].adapter_id != "x"


def test_the_plan_is_deterministic_and_independent_of_the_replicas_order():
    replicas = [replica("w3", running=14), replica("w1", running=14), replica("w2", running=1),
                replica("w4", running=1)]  # fmt: skip
    first = plan(*replicas)
    assert first == plan(*replicas) == plan(*reversed(replicas))
    assert first[0] == Migration("w3-r0", "w3-a0", "w3", "w2")  # ties: the larger id gives, the smaller takes


def test_config_is_validated_and_the_registry_builds_it():
    with pytest.raises(ValueError):
        BatchBalancingConfig(min_gap=1)
    with pytest.raises(ValueError):
        BatchBalancingConfig(interval_s=0)
    with pytest.raises(ValueError):
        BatchBalancingConfig(step_token_ms=float("nan"))
    policy = make_migration("batch-balancing")
    assert policy is not None and policy.name == "batch-balancing" and policy.interval_s() == 1.0
