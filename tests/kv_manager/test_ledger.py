"""The debt ledger: rows replaced by heartbeats, vanished workers dropped, refusals until the
next heartbeat, debt edges between live workers only."""

from __future__ import annotations

import pytest

from services.kv_manager.ledger import DebtLedger, WorkerBlocks


def row(worker_id: str, free: int = 10, total: int = 100, ts: float = 1.0, **kw) -> WorkerBlocks:
    return WorkerBlocks(worker_id, f"{worker_id}:1", free, total, reported_at=ts, **kw)


def test_replace_keeps_exactly_the_reported_workers():
    ledger = DebtLedger()
    ledger.replace([row("a"), row("b")])
    assert [r.worker_id for r in ledger.rows()] == ["a", "b"]
    ledger.replace([row("b", free=3)])
    assert "a" not in ledger and ledger.row("a") is None
    assert ledger.lendable("b") == 3 and len(ledger) == 1


def test_lendable_is_free_blocks_within_the_lending_cap():
    assert row("a", free=10).lendable_blocks == 10
    assert row("a", free=10, lend_cap_blocks=8, lent={"b": 5}).lendable_blocks == 3
    assert row("a", free=10, lend_cap_blocks=4, lent={"b": 5}).lendable_blocks == 0
    assert row("a", free=2, lend_cap_blocks=100).lendable_blocks == 2


def test_a_refusal_lasts_until_the_next_heartbeat():
    ledger = DebtLedger()
    ledger.replace([row("a", ts=1.0)])
    assert ledger.mark_refused("a") and ledger.refused("a")
    assert ledger.lendable("a") == 0
    ledger.replace([row("a", ts=1.0)])  # the same heartbeat listed again: still refused
    assert ledger.lendable("a") == 0
    ledger.replace([row("a", ts=2.0)])
    assert not ledger.refused("a") and ledger.lendable("a") == 10
    assert not ledger.mark_refused("nobody")


def test_debts_are_edges_between_live_workers():
    ledger = DebtLedger()
    ledger.replace([row("a", lent={"b": 4, "gone": 7, "a": 1}), row("b", lent={"a": 2, "c": 0})])
    assert ledger.debts() == {("b", "a"): 4, ("a", "b"): 2}
    assert dict(ledger.row("b").lent) == {"a": 2}  # zero entries dropped


def test_version_changes_on_every_change():
    ledger = DebtLedger()
    v0 = ledger.version
    ledger.replace([row("a")])
    ledger.mark_refused("a")
    assert ledger.version == v0 + 2


def test_rows_reject_negative_counts_and_empty_ids():
    with pytest.raises(ValueError, match="negative"):
        row("a", free=-1)
    with pytest.raises(ValueError, match="negative"):
        row("a", lent={"b": -2})
    with pytest.raises(ValueError, match="worker id"):
        WorkerBlocks("")
