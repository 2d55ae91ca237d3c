"""FCFS and LCFS: the running batch keeps stepping; the queue in arrival or reverse order."""

from __future__ import annotations

import pytest

from services.gpu_worker.engine.policies import make_batch_policy
from services.gpu_worker.engine.policies.batch_policy import (
    UNMERGED,
    BatchView,
    QueuedRequest,
    RunningRequest,
)


def view() -> BatchView:
    return BatchView(
        now_s=10.0,
        waiting=(
            QueuedRequest("w1", "a", 1.0, 8),
            QueuedRequest("w2", None, 2.0, 8),
            QueuedRequest("w3", "b", 3.0, 8),
        ),
        running=(RunningRequest("r1", "a", 0.5),),
        max_running=8,
        mode=UNMERGED,
    )


def test_fcfs_runs_the_batch_then_the_oldest_first():
    plan = make_batch_policy("fcfs").plan(view())
    assert plan.run == ("r1", "w1", "w2", "w3")
    assert plan.mode == UNMERGED and plan.aborts == ()


def test_lcfs_runs_the_batch_then_the_newest_first():
    assert make_batch_policy("lcfs").plan(view()).run == ("r1", "w3", "w2", "w1")


def test_an_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown batch policy 'sjf'; known: adapter_clustering, dlora"):
        make_batch_policy("sjf")
