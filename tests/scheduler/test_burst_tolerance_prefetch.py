"""dLoRA proactive prefetch by burst tolerance (peak capacity ÷ average load)."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from services.scheduler.policies.burst_tolerance_prefetch import (
    BurstToleranceConfig,
    BurstTolerancePrefetch,
    burst_tolerances,
)
from services.scheduler.policies.replica_load import ClusterLoad, Prefetch, ReplicaLoad, RequestLoad


def replica(worker_id: str, resident=(), free=1000) -> ReplicaLoad:
    return ReplicaLoad(worker_id, resident_adapters=frozenset(resident), memory_tokens=4000, free_tokens=free)


def cluster(replicas, rates, sizes=None) -> ClusterLoad:
    return ClusterLoad(tuple(replicas), adapter_rates=MappingProxyType(rates),
                       adapter_sizes=MappingProxyType(sizes or {}), mean_request_tokens=100)  # fmt: skip


def test_tolerance_is_the_holders_free_requests_over_the_rate():
    state = cluster(
        [
            replica("w1", {"hot", "cold"}, free=1000),
            replica("w2", {"hot"}, free=500),
            replica("w3", free=3000),
        ],
        {"hot": 5.0, "cold": 0.5, "nowhere": 1.0, "idle": 0.0},
    )
    # hot: (1000 + 500) / 100 = 15 requests / 5 per s = 3 s; cold: 10 / 0.5 = 20 s; nowhere: 0.
    assert burst_tolerances(state) == {"hot": pytest.approx(3.0), "cold": pytest.approx(20.0), "nowhere": 0.0}


def test_the_kv_running_requests_will_still_grow_into_is_no_headroom():
    # w3's 3,000 free tokens are spoken for by its running request's 2,950 tokens to come.
    growing = RequestLoad("r", "x", remaining_tokens=2950, context_tokens=50, running=True)
    busy = ReplicaLoad("w3", (growing,), memory_tokens=4000, free_tokens=3000)
    state = cluster(
        [replica("w1", {"hot"}, free=1000), busy, replica("w4", free=300)], {"hot": 5.0}, {"hot": 80}
    )
    assert burst_tolerances(state) == {"hot": pytest.approx(2.0)}
    assert BurstTolerancePrefetch().plan(state) == [Prefetch("hot", "w4")]


def test_lowest_tolerance_first_onto_the_lacking_replica_with_most_free_memory():
    state = cluster(
        [
            replica("w1", {"hot", "cold"}, free=1000),
            replica("w2", {"hot"}, free=500),
            replica("w3", free=3000),
        ],
        {"hot": 5.0, "cold": 0.5, "nowhere": 1.0},
        {"hot": 80, "nowhere": 640},
    )
    orders = BurstTolerancePrefetch(BurstToleranceConfig(max_tolerance_s=4.0)).plan(state)
    assert orders == [Prefetch("nowhere", "w3"), Prefetch("hot", "w3")]  # cold (20 s) tolerates bursts


def test_round_cap_and_memory_guard():
    state = cluster(
        [replica("w1", free=760), replica("w2", free=50)],
        {"a": 3.0, "b": 2.0, "c": 1.0},
        {"a": 640, "b": 80, "c": 80},
    )
    policy = BurstTolerancePrefetch(BurstToleranceConfig(max_per_round=2))
    # a fits w1 (640 + one request of 100 <= 760); then w1 has 120 left: b and c fit nowhere.
    assert policy.plan(state) == [Prefetch("a", "w1")]
    roomy = cluster([replica("w1", free=5000)], {"a": 3.0, "b": 2.0, "c": 1.0})
    assert len(policy.plan(roomy)) == 2


def test_config_refuses_nonsense():
    with pytest.raises(ValueError):
        BurstToleranceConfig(interval_s=0)
    with pytest.raises(ValueError):
        BurstToleranceConfig(max_per_round=0)
