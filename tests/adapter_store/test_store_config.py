"""The adapter_store's settings fail closed: a count, size, deadline or port it cannot run with stops it
at parse time (exit 2, one line naming the setting's flag and variable)."""

from __future__ import annotations

import pytest
from support.config_refusal import refusal

from services.adapter_store.config import AdapterStoreConfig
from services.runtime.config import parse_config


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--max-rank", "0"], "--max-rank (env LORAMESH_MAX_RANK) must be at least 1, got 0"),
        (
            ["--ram-budget-mib", "-1"],
            "--ram-budget-mib (env LORAMESH_RAM_BUDGET_MIB) must be at least 0, got -1",
        ),
        (["--http-port", "65536"], "--http-port (env LORAMESH_HTTP_PORT) must be in [0, 65535], got 65536"),
    ],
)
def test_a_setting_out_of_range_is_refused_naming_it(capsys, argv, named):
    assert refusal(capsys, AdapterStoreConfig, argv) == named


def test_the_defaults_parse():
    assert isinstance(parse_config(AdapterStoreConfig, [], environ={}), AdapterStoreConfig)
