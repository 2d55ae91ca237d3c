"""The supervisor's restart decisions over an injected clock: backoff, cap, reset, counts."""

from __future__ import annotations

import pytest

from loramesh_cli.restart_policy import RestartPolicy, RestartTracker

POLICY = RestartPolicy(initial_backoff_s=1.0, multiplier=2.0, max_backoff_s=5.0, healthy_after_s=30.0)


def test_crashes_in_a_row_double_the_wait_up_to_the_cap():
    tracker = RestartTracker(POLICY)
    now = 100.0
    tracker.started(now)
    waits = []
    for _ in range(5):
        now += 2.0  # dies 2 s after each start: never healthy
        restart_at = tracker.exited(now, -9)
        waits.append(restart_at - now)
        assert not tracker.due(restart_at - 0.01) and tracker.due(restart_at)
        now = restart_at
        tracker.started(now)
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert tracker.restarts == 5 and tracker.last_exit_code == -9


def test_a_healthy_run_resets_the_wait():
    tracker = RestartTracker(POLICY)
    tracker.started(0.0)
    assert tracker.exited(1.0, 1) == 2.0
    tracker.started(2.0)
    assert tracker.exited(3.0, 1) == 5.0  # 2 s: second crash in a row
    tracker.started(5.0)
    assert tracker.exited(5.0 + 30.0, 1) == 36.0  # ran healthy_after_s: back to 1 s
    assert tracker.crashes_in_a_row == 1


def test_running_and_never_started_processes_are_not_due():
    tracker = RestartTracker(POLICY)
    assert not tracker.due(1e9)
    tracker.started(0.0)
    assert not tracker.due(1e9) and tracker.restarts == 0 and tracker.last_exit_code is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_backoff_s": -1.0},
        {"initial_backoff_s": 10.0, "max_backoff_s": 5.0},
        {"multiplier": 0.5},
        {"healthy_after_s": 0.0},
    ],
)
def test_bad_policies_are_refused(kwargs):
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)
