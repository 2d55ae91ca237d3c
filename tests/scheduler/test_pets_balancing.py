"""PetS Alg. 3 (greedy task moves) and the adaptive interval φ = L_min / L_max vs θ."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from services.scheduler.policies import make_migration, make_prefetch
from services.scheduler.policies.pets_balancing import PetsBalancing, PetsBalancingConfig, imbalance
from services.scheduler.policies.replica_load import ClusterLoad, Migration, ReplicaLoad, RequestLoad


def replica(worker_id, queued=(), running=(), invocations=None) -> ReplicaLoad:
    requests = tuple(RequestLoad(rid, a, 10, 10, False) for rid, a in queued)
    requests += tuple(RequestLoad(rid, a, 10, 10, True) for rid, a in running)
    return ReplicaLoad(worker_id, requests, invocations=MappingProxyType(invocations or {}))


def test_interval_halves_under_imbalance_and_grows_by_delta_when_balanced():
    policy = PetsBalancing()
    assert policy.interval_s() == 10.0
    assert [policy.adapt(phi) for phi in (0.5, 0.5, 0.95, 0.1)] == [5.0, 2.5, 3.0, 1.5]
    for _ in range(10):
        policy.adapt(0.0)
    assert policy.interval_s() == 0.2  # i_min
    for _ in range(100):
        policy.adapt(1.0)
    assert policy.interval_s() == 20.0  # i_max


def test_phi_is_min_over_max_queue_length():
    state = ClusterLoad((replica("w1", queued=[("q1", "a"), ("q2", "a")], running=[("r", "b")]),
                         replica("w2", queued=[("q3", "a")])))  # fmt: skip
    assert imbalance(state) == 0.5
    assert imbalance(ClusterLoad((replica("w1"), replica("w2")))) == 1.0


def test_least_invoked_queued_task_of_the_busiest_moves_while_the_gap_shrinks():
    busy = replica(
        "w1",
        queued=[("x1", "x"), ("y1", "y"), ("y2", "y"), ("z1", "z")],
        running=[("r1", "x")],
        invocations={"x": 6, "y": 3, "z": 1},
    )
    idle = replica("w2", invocations={"x": 2})
    moves = PetsBalancing().plan(ClusterLoad((busy, idle)))
    # totals 10 / 2, gap 8: move z (1) -> 9 / 3, gap 6; move y (3) -> 6 / 6, gap 0; then the
    # busiest (w1, tie broken by id? w2 > w1: w2) has no queued task: stop.
    assert moves == [Migration("z1", "z", "w1", "w2"), Migration("y1", "y", "w1", "w2"),
                     Migration("y2", "y", "w1", "w2")]  # fmt: skip


def test_a_move_that_would_not_shrink_the_gap_is_not_made():
    busy = replica("w1", queued=[("x1", "x")], invocations={"x": 10})
    idle = replica("w2", invocations={"y": 2})
    assert PetsBalancing().plan(ClusterLoad((busy, idle))) == []  # 10/2 -> 0/12: gap 8 -> 12


def test_registries_build_policies_by_name():
    assert make_migration("none") is None and make_prefetch("none") is None
    assert make_migration("pets").name == "pets" and make_migration("co-migration").name == "co-migration"
    assert make_prefetch("burst-tolerance").name == "burst-tolerance"
    with pytest.raises(ValueError, match="known: none, batch-balancing, co-migration, pets"):
        make_migration("magic")
    with pytest.raises(ValueError):
        PetsBalancingConfig(theta=0)
