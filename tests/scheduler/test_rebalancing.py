"""Rebalancing on the live mesh, without gRPC: the policies' plans become worker calls in the
right order (the adapter is loaded on the target before the request is handed off), failures are
counted and lose nothing, and the cluster the policies see is built from the workers' listings."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from services.runtime.errors import FailedPrecondition, NotFound, Unavailable
from services.scheduler.cluster_view import ClusterSnapshot, WorkerState
from services.scheduler.policies.pets_balancing import PetsBalancing
from services.scheduler.policies.replica_load import ClusterLoad, Migration, Prefetch, RequestLoad
from services.scheduler.rebalancing import DemandWindow, Rebalancer, WorkerRequests, cluster_load, owns

SNAPSHOT = ClusterSnapshot.of([WorkerState("w0", "addr0"), WorkerState("w1", "addr1")])


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeWorkers:
    """Workers as plain listings; records every call in order."""

    def __init__(self, listings: dict[str, WorkerRequests], failing: set[str] = frozenset()):
        self.listings = listings
        self.failing = set(failing)
        self.calls: list[tuple] = []

    async def list_requests(self, address: str) -> WorkerRequests:
        if address in self.failing:
            raise Unavailable(f"{address} is down")
        return self.listings[address]

    async def load_adapter(self, address: str, adapter_id: str) -> None:
        self.calls.append(("load", address, adapter_id))
        if ("load", address) in self.failing:
            raise Unavailable("store down")

    async def hand_off(self, address: str, request_id: str, target_worker_id: str) -> int:
        self.calls.append(("hand_off", address, request_id, target_worker_id))
        known = {q.request_id for q in self.listings[address].requests}
        if request_id not in known:
            raise NotFound(f"request {request_id!r} is not on {address}")
        return 3


class FixedPlan:
    name = "fixed"

    def __init__(self, moves=(), prefetches=()):
        self.moves, self.prefetches = list(moves), list(prefetches)
        self.seen: list[ClusterLoad] = []
        self.interval_s = 1.0

    def plan(self, cluster: ClusterLoad):
        self.seen.append(cluster)
        return self.moves or self.prefetches


def listing(*requests: RequestLoad, waited=None, held=()) -> WorkerRequests:
    return WorkerRequests(
        requests=requests,
        waited_s=MappingProxyType(waited or {}),
        memory_tokens=4096,
        free_tokens=1024,
        max_running=8,
        held_adapters=frozenset(held),
        adapter_tokens=MappingProxyType({a: 64 for a in held}),
    )


BUSY = listing(
    RequestLoad("g1.0", "a", 100, 20, running=True),
    RequestLoad("g2.0", "b", 50, 10),
    RequestLoad("g3.1", "b", 70, 12),
    waited={"g2.0": 2.0, "g3.1": 4.0},
    held=("a", "b"),
)
IDLE = listing(held=("c",))


async def test_a_planned_move_loads_the_adapter_on_the_target_before_the_hand_off():
    workers = FakeWorkers({"addr0": BUSY, "addr1": IDLE})
    policy = FixedPlan(moves=[Migration("g2.0", "b", "w0", "w1")])
    rebalancer = Rebalancer(workers, migration=policy)
    done = await rebalancer.migration_round(SNAPSHOT)
    assert done == policy.moves
    assert workers.calls == [("load", "addr1", "b"), ("hand_off", "addr0", "g2.0", "w1")]
    assert (rebalancer.activity.migrations, rebalancer.activity.migration_failures) == (1, 0)
    assert rebalancer.activity.rounds == 1


async def test_a_failed_move_is_counted_and_the_next_one_still_runs():
    workers = FakeWorkers({"addr0": BUSY, "addr1": IDLE})
    gone = Migration("finished-meanwhile", "b", "w0", "w1")
    fine = Migration("g3.1", "b", "w0", "w1")
    rebalancer = Rebalancer(workers, migration=FixedPlan(moves=[gone, fine]))
    assert await rebalancer.migration_round(SNAPSHOT) == [fine]
    assert (rebalancer.activity.migrations, rebalancer.activity.migration_failures) == (1, 1)


async def test_no_hand_off_when_the_adapter_cannot_be_loaded_on_the_target():
    workers = FakeWorkers({"addr0": BUSY, "addr1": IDLE}, failing={("load", "addr1")})
    rebalancer = Rebalancer(workers, migration=FixedPlan(moves=[Migration("g2.0", "b", "w0", "w1")]))
    assert await rebalancer.migration_round(SNAPSHOT) == []
    assert [c[0] for c in workers.calls] == ["load"]  # the request stays where it is
    assert rebalancer.activity.migration_failures == 1


async def test_prefetch_loads_on_the_target_and_counts_failures():
    workers = FakeWorkers({"addr0": BUSY, "addr1": IDLE}, failing={("load", "addr0")})
    plan = FixedPlan(prefetches=[Prefetch("c", "w0"), Prefetch("a", "w1"), Prefetch("a", "gone")])
    rebalancer = Rebalancer(workers, prefetch=plan)
    assert await rebalancer.prefetch_round(SNAPSHOT) == [Prefetch("a", "w1")]
    assert (rebalancer.activity.prefetches, rebalancer.activity.prefetch_failures) == (1, 2)


async def test_the_policies_see_each_worker_with_its_requests_delays_and_demand():
    clock = FakeClock()
    demand = DemandWindow(window_s=10.0, clock=clock)
    for worker, adapter in [("w0", "b"), ("w0", "b"), ("w1", "c"), ("w0", "")]:
        demand.record(worker, adapter)
    clock.now += 4.0
    policy = FixedPlan()
    rebalancer = Rebalancer(
        FakeWorkers({"addr0": BUSY, "addr1": IDLE}, failing={"addr9"}),
        migration=policy,
        demand=demand,
        clock=clock,
    )
    await rebalancer.migration_round(SNAPSHOT)
    (cluster,) = policy.seen
    w0, w1 = cluster.replicas
    assert w0.worker_id == "w0" and w0.requests == BUSY.requests
    assert w0.queue_delay_s == pytest.approx(3.0)  # mean wait of its two queued requests
    assert w0.invocations == {"b": 2} and w1.invocations == {"c": 1}
    assert cluster.adapter_rates == pytest.approx({"b": 2 / 4.0, "c": 1 / 4.0})
    assert w1.resident_adapters == {"c"} and cluster.adapter_sizes == {"a": 64, "b": 64, "c": 64}
    assert cluster.now_s == clock.now
    clock.now += 11.0  # out of the window
    assert demand.rates() == {} and demand.invocations() == {}


async def test_a_worker_that_does_not_answer_is_left_out_of_the_round():
    snapshot = ClusterSnapshot.of([*SNAPSHOT.workers, WorkerState("w9", "addr9")])
    policy = FixedPlan()
    rebalancer = Rebalancer(FakeWorkers({"addr0": BUSY, "addr1": IDLE}, failing={"addr9"}), migration=policy)
    await rebalancer.migration_round(snapshot)
    assert [r.worker_id for r in policy.seen[0].replicas] == ["w0", "w1"]


async def test_pets_on_live_listings_moves_the_loaded_workers_queued_adapter():
    clock = FakeClock()
    demand = DemandWindow(clock=clock)
    for adapter in "aaaabb":
        demand.record("w0", adapter)
    workers = FakeWorkers({"addr0": BUSY, "addr1": IDLE})
    rebalancer = Rebalancer(workers, migration=PetsBalancing(), demand=demand, clock=clock)
    moved = await rebalancer.migration_round(SNAPSHOT)
    assert {(m.request_id, m.target) for m in moved} == {("g2.0", "w1"), ("g3.1", "w1")}
    assert workers.calls[0] == ("load", "addr1", "b")


async def test_migrate_finds_the_request_by_the_gateways_id_and_picks_a_target():
    workers = FakeWorkers({"addr0": BUSY, "addr1": IDLE})
    rebalancer = Rebalancer(workers)
    move, generated = await rebalancer.migrate(SNAPSHOT, "g3", "", lambda adapter, source: "w1")
    assert move == Migration("g3.1", "b", "w0", "w1") and generated == 3
    assert rebalancer.activity.migrations == 1
    with pytest.raises(NotFound, match="g4"):
        await rebalancer.migrate(SNAPSHOT, "g4", "w1", lambda a, s: "w1")
    with pytest.raises(FailedPrecondition, match="already on w0"):
        await rebalancer.migrate(SNAPSHOT, "g1", "w0", lambda a, s: "w1")
    with pytest.raises(NotFound, match="w7"):
        await rebalancer.migrate(SNAPSHOT, "g1", "w7", lambda a, s: "w1")


def test_a_workers_request_id_belongs_to_its_gateway_request():
    assert owns("abc.0", "abc") and owns("abc.12", "abc") and owns("abc.3", "abc.3")
    assert not owns("abcd.0", "abc") and not owns("abc.x", "abc") and not owns("ab.0", "abc")


def test_cluster_load_of_no_requests_uses_the_default_request_size():
    cluster = cluster_load({"w1": IDLE}, DemandWindow(clock=FakeClock()), 0.0)
    assert cluster.mean_request_tokens == 256.0
