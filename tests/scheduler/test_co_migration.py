"""dLoRA co-migration: the relaxed LP over the top-K replicas, rounded and repaired."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.policies.co_migration import CoMigration, CoMigrationConfig, makespan, replica_cost
from services.scheduler.policies.replica_load import ClusterLoad, ReplicaLoad, RequestLoad

ALWAYS = CoMigrationConfig(queue_delay_trigger_s=0.0, top_k=2)
SIZES = {"a": 80, "b": 640, "c": 160, "d": 320}


def replica(worker_id, requests=(), resident=("a",), free=10_000, delay=1.0) -> ReplicaLoad:
    return ReplicaLoad(worker_id, tuple(requests), frozenset(resident), memory_tokens=20_000, free_tokens=free,
                       adapter_tokens=MappingProxyType(SIZES), queue_delay_s=delay)  # fmt: skip


def queued(rid, adapter="a", remaining=100, context=20, running=False) -> RequestLoad:
    return RequestLoad(rid, adapter, remaining, context, running)


def cluster(*replicas) -> ClusterLoad:
    return ClusterLoad(replicas=tuple(replicas), adapter_sizes=MappingProxyType(SIZES))


def test_an_overloaded_replica_sheds_half_its_queue_to_an_idle_one_holding_the_adapter():
    busy = replica("w1", [queued(f"r{i}") for i in range(4)])
    state = cluster(busy, replica("w2"))
    moves = CoMigration(ALWAYS).plan(state)
    assert len(moves) == 2 and {(m.source, m.target, m.adapter_id) for m in moves} == {("w1", "w2", "a")}
    assert makespan(state.replicas, moves, ALWAYS, SIZES) == (pytest.approx(2 * 101), True)


def test_nothing_moves_below_the_triggers():
    calm = CoMigrationConfig(queue_delay_trigger_s=5.0, free_memory_trigger=0.05)
    state = cluster(replica("w1", [queued(f"r{i}") for i in range(4)]), replica("w2"))
    assert CoMigration(calm).plan(state) == []
    full = cluster(replica("w1", [queued(f"r{i}") for i in range(4)], free=100), replica("w2"))
    assert CoMigration(calm).plan(full)  # under 5% of the pool free: the memory trigger


def test_target_memory_bounds_the_moves_and_the_adapter_counts_against_it():
    busy = replica("w1", [queued(f"r{i}", adapter="b") for i in range(4)], resident=("b",))
    # w2 lacks b (640 tokens): 680 free fits b and two requests of 20 tokens, not three.
    moves = CoMigration(ALWAYS).plan(cluster(busy, replica("w2", resident=(), free=680)))
    assert len(moves) == 2
    assert CoMigration(ALWAYS).plan(cluster(busy, replica("w2", resident=(), free=600))) == []


def test_running_requests_move_only_when_recomputing_them_pays():
    # One long running request: moving it costs its 1,000-token context again (50 token-steps).
    busy = replica(
        "w1", [queued("long", remaining=40, context=1000, running=True), queued("q", remaining=30)]
    )
    moves = CoMigration(ALWAYS).plan(cluster(busy, replica("w2")))
    assert [m.request_id for m in moves] == ["q"]  # 40 vs 31: better than 71 on w1 alone


def test_top_k_limits_the_replicas_considered():
    one = CoMigrationConfig(queue_delay_trigger_s=0.0, top_k=1)
    state = cluster(
        replica("w1", [queued(f"x{i}") for i in range(6)]),
        replica("w2", [queued(f"y{i}") for i in range(4)]),
        replica("w3"),
        replica("w4", [queued("z")]),
    )
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
        replicas.append(replica(f"w{j}", requests, resident, free=free, delay=draw(st.floats(0, 3))))
    return cluster(*replicas)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(state=clusters(), top_k=st.integers(1, 3))
def test_the_plan_is_valid_and_never_worse_than_no_migration(state, top_k):
    config = CoMigrationConfig(top_k=top_k, queue_delay_trigger_s=1.0)
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
