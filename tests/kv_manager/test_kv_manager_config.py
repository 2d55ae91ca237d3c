"""The kv_manager's settings fail closed: a count, size, deadline or port it cannot run with stops it
at parse time (exit 2, one line naming the setting's flag and variable)."""

from __future__ import annotations

import pytest
from support.config_refusal import refusal

from services.kv_manager.config import KVManagerConfig
from services.runtime.config import parse_config


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (
            ["--max-candidates", "0"],
            "--max-candidates (env LORAMESH_MAX_CANDIDATES) must be at least 1, got 0",
        ),
        (
            ["--dgfm-interval-s", "-1"],
            "--dgfm-interval-s (env LORAMESH_DGFM_INTERVAL_S) must be at least 0, got -1.0",
        ),
        (
            ["--retry-after-s", "0"],
            "--retry-after-s (env LORAMESH_RETRY_AFTER_S) must be more than 0, got 0.0",
        ),
    ],
)
def test_a_setting_out_of_range_is_refused_naming_it(capsys, argv, named):
    assert refusal(capsys, KVManagerConfig, argv) == named


def test_the_defaults_parse():
    assert isinstance(parse_config(KVManagerConfig, [], environ={}), KVManagerConfig)
