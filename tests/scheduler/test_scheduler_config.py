"""The scheduler's settings fail closed: a count, size, deadline or port it cannot run with stops it
at parse time (exit 2, one line naming the setting's flag and variable)."""

from __future__ import annotations

import pytest
from support.config_refusal import refusal

from services.runtime.config import parse_config
from services.scheduler.config import SchedulerConfig


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (
            ["--max-queue-per-worker", "0"],
            "--max-queue-per-worker (env LORAMESH_MAX_QUEUE_PER_WORKER) must be at least 1, got 0",
        ),
        (
            ["--demand-window-s", "0"],
            "--demand-window-s (env LORAMESH_DEMAND_WINDOW_S) must be more than 0, got 0.0",
        ),
        (
            ["--min-tokens-per-s", "-1"],
            "--min-tokens-per-s (env LORAMESH_MIN_TOKENS_PER_S) must be more than 0, got -1.0",
        ),
        (["--port", "-1"], "--port (env LORAMESH_PORT) must be in [0, 65535], got -1"),
    ],
)
def test_a_setting_out_of_range_is_refused_naming_it(capsys, argv, named):
    assert refusal(capsys, SchedulerConfig, argv) == named


def test_the_defaults_parse():
    assert isinstance(parse_config(SchedulerConfig, [], environ={}), SchedulerConfig)
