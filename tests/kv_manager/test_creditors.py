"""SuggestCreditors: locality first, then most lendable, at most three, never the debtor, never
a full or refused worker; bad input gets a domain error naming the problem."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.kv_manager.creditors import CreditorConfig, CreditorIndex
from services.kv_manager.ledger import DebtLedger, WorkerBlocks
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted


def ledger_of(*rows: WorkerBlocks) -> DebtLedger:
    ledger = DebtLedger()
    ledger.replace(rows)
    return ledger


def w(worker_id: str, free: int, topology: str = "rack1", ts: float = 1.0, **kw) -> WorkerBlocks:
    return WorkerBlocks(worker_id, f"{worker_id}:7000", free, 100, topology=topology, reported_at=ts, **kw)


def ids(candidates) -> list[str]:
    return [c.worker_id for c in candidates]


def test_same_topology_first_then_most_free():
    ledger = ledger_of(
        w("d", 0),
        w("near-small", 5),
        w("near-big", 20),
        w("far-huge", 90, "rack2"),
        w("far-big", 50, "rack2"),
    )
    got = CreditorIndex().suggest(ledger, "d", 8, now=0.0)
    assert ids(got) == ["near-big", "near-small", "far-huge"]
    assert [c.same_topology for c in got] == [True, True, False]
    assert got[0].address == "near-big:7000" and got[0].lendable_blocks == 20


def test_full_refused_and_the_debtor_itself_are_never_suggested():
    ledger = ledger_of(w("d", 50), w("full", 0), w("capped", 9, lend_cap_blocks=3, lent={"x": 3}), w("ok", 1))
    index = CreditorIndex()
    assert ids(index.suggest(ledger, "d", 1, now=0.0)) == ["ok"]
    ledger.mark_refused("ok")
    with pytest.raises(ResourceExhausted, match="no worker other than 'd'"):
        index.suggest(ledger, "d", 1, now=0.0)


def test_more_than_every_other_worker_would_ever_lend_is_refused_as_hopeless():
    """Waiting helps when lenders are busy (RESOURCE_EXHAUSTED), not when the blocks asked for
    exceed what the others lend even when idle (their caps, or whole pools without one)."""
    ledger = ledger_of(
        w("d", 0), w("a", 10, lend_cap_blocks=30), w("b", 0, lend_cap_blocks=40, lent={"x": 40})
    )
    index = CreditorIndex()
    assert ids(index.suggest(ledger, "d", 70, now=0.0)) == ["a"]  # 70 <= 30 + 40: worth waiting
    with pytest.raises(FailedPrecondition, match="needs 71 KV blocks .* at most 70 together"):
        index.suggest(ledger, "d", 71, now=0.0)
    uncapped = ledger_of(w("d", 0), w("a", 0))
    with pytest.raises(ResourceExhausted):
        index.suggest(uncapped, "d", 100, now=0.0)  # a's whole pool, once free
    with pytest.raises(FailedPrecondition):
        index.suggest(uncapped, "d", 101, now=0.0)
    uncapped.replace(uncapped.rows(), unreported=["starting"])  # a live worker not heard from yet
    with pytest.raises(ResourceExhausted):
        index.suggest(uncapped, "d", 101, now=0.0)  # it may lend: worth waiting


def test_bad_input_names_the_problem():
    ledger = ledger_of(w("d", 0), w("a", 5))
    index = CreditorIndex()
    with pytest.raises(InvalidArgument, match="blocks >= 1, got 0"):
        index.suggest(ledger, "d", 0, now=0.0)
    with pytest.raises(InvalidArgument, match="debtor_id"):
        index.suggest(ledger, "", 3, now=0.0)
    with pytest.raises(NotFound, match="'ghost' is not in the ledger"):
        index.suggest(ledger, "ghost", 3, now=0.0)


def test_workers_are_sorted_periodically_not_per_query():
    ledger = ledger_of(w("d", 0), w("a", 5))
    index = CreditorIndex(CreditorConfig(resort_interval_s=10.0))
    assert ids(index.suggest(ledger, "d", 1, now=0.0)) == ["a"] and index.sorts == 1
    ledger.replace([w("d", 0), w("a", 5, ts=2.0), w("b", 30, ts=2.0)])
    # Within the interval the old order stands: b (new) is not known to the index yet...
    assert ids(index.suggest(ledger, "d", 1, now=5.0)) == ["a"] and index.sorts == 1
    # ...after it, the workers are sorted again.
    assert ids(index.suggest(ledger, "d", 1, now=10.0)) == ["b", "a"] and index.sorts == 2
    # An unchanged ledger is not sorted again.
    index.suggest(ledger, "d", 1, now=100.0)
    assert index.sorts == 2


def test_a_worker_that_filled_up_since_the_sort_is_skipped():
    ledger = ledger_of(w("d", 0), w("a", 5), w("b", 4))
    index = CreditorIndex(CreditorConfig(resort_interval_s=10.0))
    index.suggest(ledger, "d", 1, now=0.0)
    ledger.replace([w("d", 0), w("a", 0, ts=2.0), w("b", 4)])
    assert ids(index.suggest(ledger, "d", 1, now=1.0)) == ["b"]


workers = st.lists(
    st.builds(
        w,
        st.sampled_from([f"w{i}" for i in range(12)]),
        st.integers(0, 40),
        st.sampled_from(["rack1", "rack2", "rack3"]),
        lend_cap_blocks=st.none() | st.integers(0, 40),
        lent=st.dictionaries(st.sampled_from(["w0", "w1", "w2"]), st.integers(0, 20), max_size=2),
    ),
    min_size=1,
    max_size=12,
    unique_by=lambda r: r.worker_id,
)


@settings(max_examples=200, deadline=None)
@given(workers, st.data())
def test_suggestions_are_at_most_three_distinct_lenders_never_the_debtor(rows, data):
    ledger = ledger_of(*rows)
    for refused in data.draw(st.lists(st.sampled_from([r.worker_id for r in rows]), max_size=3)):
        ledger.mark_refused(refused)
    debtor = data.draw(st.sampled_from([r.worker_id for r in rows]))
    blocks = data.draw(st.integers(1, 64))
    lenders = [r for r in rows if r.worker_id != debtor and ledger.lendable(r.worker_id) > 0]
    index = CreditorIndex()
    if blocks > sum(r.lend_ceiling for r in rows if r.worker_id != debtor):
        with pytest.raises(FailedPrecondition):
            index.suggest(ledger, debtor, blocks, now=0.0)
        return
    if not lenders:
        with pytest.raises(ResourceExhausted):
            index.suggest(ledger, debtor, blocks, now=0.0)
        return
    got = index.suggest(ledger, debtor, blocks, now=0.0)
    assert 1 <= len(got) <= 3 and len(set(ids(got))) == len(got)
    assert debtor not in ids(got)
    assert all(ledger.lendable(c.worker_id) == c.lendable_blocks > 0 for c in got)
    # Ranking: locality first, then most lendable; nothing better was left out.
    keys = [(not c.same_topology, -c.lendable_blocks, c.worker_id) for c in got]
    assert keys == sorted(keys)
    topology = ledger.row(debtor).topology
    left_out = [r for r in lenders if r.worker_id not in ids(got)]
    if len(got) < 3:
        assert not left_out
    assert all(
        (r.topology != topology, -ledger.lendable(r.worker_id), r.worker_id) > keys[-1] for r in left_out
    )
