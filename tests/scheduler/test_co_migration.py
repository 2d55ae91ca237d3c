"""dLoRA co-migration: the relaxed LP over the top-K replicas, rounded and repaired."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.policies.co_migration import CoMigration, CoMigrationConfig, makespan, replica_cost
from services.scheduler.policies.replica_load import ClusterLoad, ReplicaLoad, RequestLoad

ECONOMICS = {"step_base_ms": 200.0, "step_per_request_ms": 0.0, "prefill_token_ms": 8.0,
             "adapter_load_s": 1.0, "mean_remaining_tokens": 100.0, "slot_memory_tokens": 20.0}  # fmt: skip
"""A step costs 200 ms whatever the batch: a full batch of 2 works off 0.1 s per queued token,
and a free slot (one per 20 free tokens) absorbs 100 tokens (10 s) of queue."""
ALWAYS = CoMigrationConfig(queue_delay_trigger_s=0.0, top_k=2, **ECONOMICS)
SIZES = {"a": 80, "b": 640, "c": 160, "d": 320}


def replica(worker_id, requests=(), resident=("a",), free=10_000, delay=1.0, max_running=2) -> ReplicaLoad:
    return ReplicaLoad(worker_id, tuple(requests), frozenset(resident), memory_tokens=20_000, free_tokens=free,
                       adapter_tokens=MappingProxyType(SIZES), queue_delay_s=delay,
                       max_running=max_running)  # fmt: skip


def queued(rid, adapter="a", remaining=100, context=20, running=False) -> RequestLoad:
    return RequestLoad(rid, adapter, remaining, context, running)


def busy(worker_id, waiting, adapter="a", running=2) -> ReplicaLoad:
    """A full batch of 2 and ``waiting`` queued requests of 100 tokens."""
    requests = [queued(f"{worker_id}-run{i}", adapter, running=True) for i in range(running)]
    requests += [queued(f"{worker_id}-q{i}", adapter) for i in range(waiting)]
    return replica(worker_id, requests, resident=(adapter,))


def cluster(*replicas) -> ClusterLoad:
    return ClusterLoad(replicas=tuple(replicas), adapter_sizes=MappingProxyType(SIZES))


def test_a_replica_with_a_queue_sheds_queued_requests_to_free_slots_until_the_waits_meet():
    # w1 waits 4 x 100 tokens x 0.1 s = 40 s; w2's two free slots absorb 20 s. Moving k queued
    # requests leaves 40 − 10k on w1 and 10k − 20 on w2: k = 3, both 10 s. The running ones stay.
    state = cluster(busy("w1", 4), replica("w2"))
    assert replica_cost(state.replicas[0], ALWAYS) == pytest.approx(40.0)
    moves = CoMigration(ALWAYS).plan(state)
    assert len(moves) == 3 and {(m.source, m.target, m.adapter_id) for m in moves} == {("w1", "w2", "a")}
    assert all("-q" in m.request_id for m in moves)
    assert makespan(state.replicas, moves, ALWAYS, SIZES) == (pytest.approx(10.0), True)


def test_batch_economics_moves_nothing_between_replicas_whose_slots_absorb_their_queues():
    # Both have a free slot for their one queued request: no queue wait, nothing to gain.
    state = cluster(busy("w1", 1, running=1), replica("w2"))
    assert CoMigration(ALWAYS).plan(state) == []


def test_nothing_moves_below_the_triggers():
    calm = CoMigrationConfig(queue_delay_trigger_s=5.0, free_memory_trigger=0.05, **ECONOMICS)
    state = cluster(busy("w1", 4), replica("w2"))
    assert CoMigration(calm).plan(state) == []
    full = cluster(replace(busy("w1", 4), free_tokens=100), replica("w2"))
    assert CoMigration(calm).plan(full)  # under 5% of the pool free: the memory trigger


def test_the_adapter_must_fit_the_target_pool_and_its_fetch_adds_to_the_target_wait():
    # w2 lacks b (640 tokens): with 680 free it takes b, and three requests leave w1 at 10 s
    # and w2 at 10 + 1 s of fetch; with 600 free b does not fit and nothing moves.
    state = cluster(busy("w1", 4, adapter="b"), replica("w2", resident=(), free=680))
    moves = CoMigration(ALWAYS).plan(state)
    assert len(moves) == 3 and {m.adapter_id for m in moves} == {"b"}
    assert makespan(state.replicas, moves, ALWAYS, SIZES) == (pytest.approx(11.0), True)
    lacking = cluster(busy("w1", 4, adapter="b"), replica("w2", resident=(), free=600))
    assert CoMigration(ALWAYS).plan(lacking) == []


def test_a_full_pool_leaves_no_slot_to_absorb_a_queue():
    # w2 has two free batch slots but 20 free tokens: one slot (10 s). 40 − 10k against
    # 10k − 10: the best whole plan leaves 20 s.
    state = cluster(busy("w1", 4), replica("w2", free=20))
    moves = CoMigration(ALWAYS).plan(state)
    assert makespan(state.replicas, moves, ALWAYS, SIZES) == (pytest.approx(20.0), True)


def test_only_queued_requests_move_unless_running_ones_may_and_their_recompute_is_priced():
    source = replica("w1", [queued("long", remaining=40, context=1000, running=True), queued("q", remaining=30)],
                     max_running=1)  # fmt: skip
    state = cluster(source, replica("w2", max_running=1))
    assert [m.request_id for m in CoMigration(ALWAYS).plan(state)] == ["q"]
    with_running = CoMigrationConfig(queue_delay_trigger_s=0.0, move_running=True, **ECONOMICS)
    # The running request waits for nothing where it is; moving it would add its recompute.
    assert [m.request_id for m in CoMigration(with_running).plan(state)] == ["q"]


def test_top_k_limits_the_replicas_considered():
    one = CoMigrationConfig(queue_delay_trigger_s=0.0, top_k=1, **ECONOMICS)
    state = cluster(busy("w1", 6), busy("w2", 4), replica("w3"), busy("w4", 1))
    over, under = CoMigration(one).select(state)
    assert [r.worker_id for r in over] == ["w1"] and [r.worker_id for r in under] == ["w3"]
    assert {m.source for m in CoMigration(one).plan(state)} == {"w1"}


@st.composite
def clusters(draw):
    n = draw(st.integers(2, 5))
    replicas = []
    for j in range(n):
        requests = [
            RequestLoad(
                f"w{j}-r{i}",
                draw(st.sampled_from(["a", "b", "c", "d", ""])),
                draw(st.integers(1, 200)),
                draw(st.integers(1, 600)),
                draw(st.booleans()),
            )
            for i in range(draw(st.integers(0, 8)))
        ]
        resident = frozenset(draw(st.sets(st.sampled_from(sorted(SIZES)))))
        free = draw(st.integers(0, 3000))
        replicas.append(replica(f"w{j}", requests, resident, free=free, delay=draw(st.floats(0, 3)),
                                max_running=draw(st.integers(1, 4))))  # fmt: skip
    return cluster(*replicas)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(state=clusters(), top_k=st.integers(1, 3), move_running=st.booleans())
def test_the_plan_is_valid_and_never_worse_than_no_migration(state, top_k, move_running):
    config = CoMigrationConfig(top_k=top_k, queue_delay_trigger_s=1.0, move_running=move_running, **ECONOMICS)
    moves = CoMigration(config).plan(state)
    by_id = {r.worker_id: r for r in state.replicas}
    ids = [m.request_id for m in moves]
    assert len(ids) == len(set(ids))  # each request placed once
    for move in moves:
        assert move.source != move.target and move.target in by_id
        request = next(q for q in by_id[move.source].requests if q.request_id == move.request_id)
        assert request.adapter_id == move.adapter_id  # the adapter goes with its request
    before, _ = makespan(state.replicas, [], config, SIZES)
    after, fits = makespan(state.replicas, moves, config, SIZES)
    assert fits  # memory: incoming requests and adapters fit each target's free pool
    assert after <= before + 1e-9
    if moves:
        assert after < before
    assert max(replica_cost(r, config) for r in state.replicas) == pytest.approx(before)
