"""Adapter clustering: at most ``max_adapters`` distinct adapters per batch, FCFS otherwise, and
a request that waited ``aging_s`` goes in past the cap."""

from __future__ import annotations

import pytest

from services.gpu_worker.engine.policies.adapter_clustering import AdapterClustering, AdapterClusteringConfig
from services.gpu_worker.engine.policies.batch_policy import (
    UNMERGED,
    BatchView,
    QueuedRequest,
    RunningRequest,
)


def view(now: float, waiting: list[tuple[str, str | None, float]], running=(), max_running=8) -> BatchView:
    return BatchView(
        now,
        tuple(QueuedRequest(rid, adapter, t, 8) for rid, adapter, t in waiting),
        tuple(RunningRequest(rid, adapter, 0.0) for rid, adapter in running),
        max_running,
        UNMERGED,
    )


def test_requests_of_a_third_adapter_wait_while_two_are_in_the_batch():
    policy = AdapterClustering(AdapterClusteringConfig(max_adapters=2, aging_s=5.0))
    plan = policy.plan(
        view(
            1.0,
            [("w1", "c", 0.5), ("w2", "a", 0.6), ("w3", None, 0.7), ("w4", "b", 0.8)],
            [("r1", "a"), ("r2", "b")],
        )
    )
    assert plan.run == ("r1", "r2", "w2", "w3", "w4")
    assert policy.skipped == 1


def test_a_request_that_waited_long_enough_goes_in_past_the_cap():
    policy = AdapterClustering(AdapterClusteringConfig(max_adapters=1, aging_s=5.0))
    plan = policy.plan(view(10.0, [("old", "c", 4.0), ("new", "d", 9.0)], [("r1", "a")]))
    assert plan.run == ("r1", "old")


def test_the_first_adapters_admitted_fix_the_cluster():
    policy = AdapterClustering(AdapterClusteringConfig(max_adapters=1, aging_s=60.0))
    plan = policy.plan(view(1.0, [("w1", "x", 0.1), ("w2", "y", 0.2), ("w3", "x", 0.3)]))
    assert plan.run == ("w1", "w3")


def test_the_batch_limit_stops_admission():
    policy = AdapterClustering(AdapterClusteringConfig(max_adapters=4))
    plan = policy.plan(view(1.0, [(f"w{i}", "a", 0.1 * i) for i in range(5)], [("r1", "a")], max_running=3))
    assert plan.run == ("r1", "w0", "w1")


@pytest.mark.parametrize("kwargs", [{"max_adapters": 0}, {"aging_s": -1.0}])
def test_bad_config_is_refused(kwargs):
    with pytest.raises(ValueError):
        AdapterClusteringConfig(**kwargs)
