"""WorkerLoad heartbeats: JSON with the DESIGN §4 keys, parsed into ledger rows."""

from __future__ import annotations

import pytest

from mesh_api.v1.types_pb2 import WorkerLoad
from services.kv_manager.heartbeats import ledger_rows
from services.kv_manager.ledger import WorkerBlocks
from services.runtime.etcd.worker_load import worker_load_from_report, worker_load_to_report


def test_worker_load_json_keeps_the_design_keys_and_round_trips():
    load = WorkerLoad(queue=2, running=1, free_pages=7, total_pages=9, tokens_per_s=12.5, ts=3.0)
    load.resident_adapters.append("sql")
    load.lent_blocks["w2"] = 4
    report = worker_load_to_report(load)
    for key in ("queue", "running", "free_pages", "total_pages", "resident_adapters", "tokens_per_s", "ts"):
        assert key in report
    assert report["free_pages"] == 7 and report["lent_blocks"] == {"w2": 4} and report["free_blocks"] == 0
    assert "lend_cap_blocks" not in report  # absent, not 0: no cap beyond free blocks
    assert worker_load_from_report(report) == load


def test_unknown_keys_are_ignored_and_bad_values_refused():
    assert worker_load_from_report({"ready": False, "queue": 3}).queue == 3
    with pytest.raises(ValueError, match="queue"):
        worker_load_from_report({"queue": -1})


def test_rows_need_both_a_member_key_and_a_well_formed_report():
    reports = {
        "w1": worker_load_to_report(
            WorkerLoad(free_blocks=5, total_blocks=8, topology="r1", lend_cap_blocks=2, ts=4)
        ),
        "w2": {"free_blocks": "many"},
        "w3": {"free_blocks": 1},
        "scheduler-1": {"workers": 3},
    }
    rows = ledger_rows({"w1": "h:1", "w2": "h:2", "w4": "h:4"}, reports)
    assert rows == [WorkerBlocks("w1", "h:1", 5, 8, topology="r1", lend_cap_blocks=2, reported_at=4.0)]
