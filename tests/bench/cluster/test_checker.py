"""The nemesis checker over hand-built histories: the one-line verdict when everything holds,
and each invariant's violation named when it does not."""

from __future__ import annotations

import itertools

import pytest

from bench.cluster.checker import check, final_store_findings, stream_tokens
from bench.cluster.history import History, OpKind, Outcome, Sampling
from bench.cluster.observations import (
    BlockReport,
    Heal,
    LeaderTerm,
    LeaderWrite,
    LedgerSnapshot,
    StoreObservation,
)

REFERENCE = {"p0": [10, 11, 12, 13]}


def new_history() -> History:
    ticks = itertools.count()
    return History(clock=lambda: float(next(ticks)))


def upload(history: History, name: str, digest: str, outcome: Outcome = Outcome.OK, error: str = "") -> None:
    history.complete(history.invoke("up", OpKind.UPLOAD, name, digest=digest), outcome, error=error)


def stream(
    history: History,
    tokens,
    sampling=Sampling.DETERMINISTIC,
    finish="length",
    resumed_at=(),
    kind=OpKind.GENERATE_STREAM,
    outcome=Outcome.OK,
    error="",
):
    op = history.invoke("gen", kind, "p0", sampling=sampling)
    history.complete(
        op,
        outcome,
        tokens=tuple(enumerate(tokens)),
        finish_reason=finish,
        resumed_at=tuple(resumed_at),
        error=error,
    )


def balanced_ledger() -> list[LedgerSnapshot]:
    lending = BlockReport("w1", free_blocks=6, total_blocks=10, lent={"w2": 4})
    borrowing = BlockReport("w2", free_blocks=0, total_blocks=10, borrowed={"w1": 4})
    return [
        LedgerSnapshot(1.0, (lending, borrowing)),
        LedgerSnapshot(2.0, (BlockReport("w1", 10, 10), BlockReport("w2", 10, 10))),
    ]


def test_a_clean_run_is_one_line_with_the_counts():
    history = new_history()
    upload(history, "a1", "d1")
    upload(history, "a2", "d2", Outcome.INFO, "UNAVAILABLE: reply lost")  # may or may not exist
    history.complete(history.invoke("f", OpKind.FETCH, "a1"), Outcome.OK, digest="d1")
    history.complete(history.invoke("l", OpKind.LIST, ""), Outcome.OK, names=("a1",))
    stream(history, REFERENCE["p0"])
    stream(history, REFERENCE["p0"], kind=OpKind.BORROW)
    verdict = check(
        history.ops(),
        final_store=StoreObservation(frozenset({"a1"}), {"a1": "d1"}),
        references=REFERENCE,
        ledger=balanced_ledger(),
    )
    assert verdict.holds, verdict.report()
    assert verdict.summary == "6 sent, 5 ok, 0 lost, 0 corrupted, ledger balanced"
    assert (verdict.streams, verdict.borrowed_streams) == (2, 1)


def test_without_block_reports_the_ledger_is_not_claimed():
    assert check([]).summary == "0 sent, 0 ok, 0 lost, 0 corrupted, ledger not observed"


def test_an_acknowledged_upload_missing_unfetchable_or_changed_at_the_end_is_named():
    history = new_history()
    for name in ("gone", "unreadable", "changed", "fine"):
        upload(history, name, f"d-{name}")
    upload(history, "refused", "d-refused", Outcome.FAIL, "INVALID_ARGUMENT: bad rank")
    final = StoreObservation(
        listed=frozenset({"unreadable", "changed", "fine", "refused"}),
        digests={"changed": "other", "fine": "d-fine", "refused": "d-refused"},
        fetch_errors={"unreadable": "NOT_FOUND: no blob"},
    )
    verdict = check(history.ops(), final_store=final)
    assert verdict.lost == [
        "upload gone acknowledged but not listed at the end",
        "upload unreadable acknowledged but not fetchable at the end",
    ]
    assert verdict.corrupted == [
        "upload changed fetched with other bytes at the end",
        "upload refused failed but is listed at the end (a phantom)",
    ]
    assert verdict.summary.startswith(
        "5 sent, 4 ok, 2 lost, 2 corrupted, ledger not observed; lost: upload gone acknowledged"
    )
    assert "(and 1 more)" in verdict.summary


def test_the_store_findings_are_shared_with_the_store_nemesis():
    found = final_store_findings(
        {"a": frozenset({"x"}), "b": frozenset({"y"})}, StoreObservation(frozenset({"b"}), {"b": "z"})
    )
    assert (found.missing_from_listing, found.not_fetchable, found.wrong_bytes) == (["a"], [], ["b"])


def test_reads_during_the_run_see_every_upload_acknowledged_before_they_began():
    history = new_history()
    early_fetch = history.invoke("f", OpKind.FETCH, "a1")  # before the upload was acknowledged
    upload(history, "a1", "d1")
    history.complete(early_fetch, Outcome.FAIL, error="NOT_FOUND: no adapter a1")
    history.complete(history.invoke("f", OpKind.FETCH, "a1"), Outcome.FAIL, error="NOT_FOUND: no adapter a1")
    history.complete(history.invoke("f", OpKind.FETCH, "a1"), Outcome.FAIL, error="UNAVAILABLE: partitioned")
    history.complete(history.invoke("f", OpKind.FETCH, "a1"), Outcome.OK, digest="never-uploaded")
    history.complete(history.invoke("l", OpKind.LIST, "a"), Outcome.OK, names=())
    history.complete(history.invoke("l", OpKind.LIST, "b"), Outcome.OK, names=())  # another prefix
    verdict = check(history.ops())
    assert verdict.lost == [
        "fetch #2 of acknowledged a1 answered NOT_FOUND: no adapter a1",
        "list #5 missed acknowledged a1",
    ]
    assert verdict.corrupted == ["fetch #4 of a1 returned bytes never uploaded"]


@pytest.mark.parametrize(
    "deliveries, problem",
    [
        ([(0, 10), (2, 12)], "tokens 1..1 lost (next came token 2)"),
        ([(0, 10), (1, 11), (1, 11)], "token 1 repeated"),
        ([(0, 10), (1, 11), (1, 99)], "token 1 changed from 11 to 99"),
        ([(0, 10), (1, 11)], ""),
    ],
)
def test_token_deliveries_have_no_gap_repeat_or_change(deliveries, problem):
    assert stream_tokens(deliveries)[1] == problem


def test_a_stream_that_never_completes_or_lacks_a_finish_reason_is_lost():
    history = new_history()
    stream(history, [10], outcome=Outcome.INFO)
    stream(history, [10, 11], finish="")
    history.invoke("gen", OpKind.BORROW, "p0")  # its client never came back
    verdict = check(history.ops(), references=REFERENCE)
    assert len(verdict.lost) == 3 and not verdict.corrupted
    assert "ended without a finish reason after 2 tokens" in verdict.lost[1]


def test_a_refused_or_timed_out_stream_is_counted_not_lost_and_what_it_delivered_is_judged():
    history = new_history()
    stream(history, REFERENCE["p0"])
    refusal = "RESOURCE_EXHAUSTED: its 530 tokens need 34 KV blocks ... no worker lent the rest"
    stream(history, [], finish="", kind=OpKind.BORROW, outcome=Outcome.FAIL, error=refusal)
    stream(history, [10, 11], finish="", outcome=Outcome.INFO, error="DEADLINE_EXCEEDED: deadline passed")
    stream(history, [10, 99], finish="", outcome=Outcome.INFO, error="DEADLINE_EXCEEDED: deadline passed")
    stream(history, [10], finish="", outcome=Outcome.FAIL, error="UNAVAILABLE: no gateway")  # lost
    verdict = check(history.ops(), references=REFERENCE, ledger=balanced_ledger())
    assert verdict.refused == [f"borrow #1 (p0, gen) after 0 tokens: {refusal}"]
    assert [line.split(":")[0] for line in verdict.timed_out] == [
        "generate-stream #2 (p0, gen) after 2 tokens",
        "generate-stream #3 (p0, gen) after 2 tokens",
    ]
    assert verdict.corrupted == [
        "generate-stream #3 (p0, gen) differs from its undisturbed run at token 1: 99 instead of 11"
    ]
    assert verdict.lost == ["generate-stream #4 (p0, gen) did not complete: fail UNAVAILABLE: no gateway"]
    assert verdict.summary.startswith(
        "5 sent, 1 ok, 1 refused, 2 timed out, 1 lost, 1 corrupted, ledger balanced"
    )
    assert "  timed out: generate-stream #2 (p0, gen) after 2 tokens: DEADLINE_EXCEEDED" in verdict.report()


def test_a_deterministic_stream_equals_its_undisturbed_run():
    history = new_history()
    stream(history, [10, 11, 99, 13], resumed_at=[2])
    stream(history, [10, 11, 12])
    verdict = check(history.ops(), references=REFERENCE)
    assert verdict.corrupted == [
        "generate-stream #0 (p0, gen) differs from its undisturbed run at token 2: 99 instead of 12",
        "generate-stream #1 (p0, gen) differs from its undisturbed run at token 3: the end instead of 13",
    ]


def test_a_greedy_stream_may_take_another_path_only_after_it_was_continued_elsewhere():
    history = new_history()
    stream(history, [10, 11, 99, 98, 97], Sampling.GREEDY, resumed_at=[2])  # valid continuation
    stream(history, [10, 99, 98], Sampling.GREEDY, resumed_at=[2])  # changed before the resume
    stream(history, [10, 11, 12, 99], Sampling.GREEDY)  # never resumed: must equal the reference
    verdict = check(history.ops(), references=REFERENCE)
    assert [line.split(" differs")[0] for line in verdict.corrupted] == [
        "generate-stream #1 (p0, gen)",
        "generate-stream #2 (p0, gen)",
    ]


def test_a_sampled_stream_needs_only_to_be_well_formed():
    history = new_history()
    stream(history, [1, 2, 3], Sampling.SAMPLED, finish="stop")
    op = history.invoke("gen", OpKind.GENERATE_STREAM, "p9", sampling=Sampling.SAMPLED)
    history.complete(op, Outcome.OK, tokens=((0, 1), (0, 1)), finish_reason="stop")
    verdict = check(history.ops())
    assert verdict.corrupted == ["generate-stream #1 (p9, gen): token 0 repeated"]


def test_a_stream_needing_a_reference_without_one_is_a_harness_error():
    history = new_history()
    stream(history, [1])
    with pytest.raises(ValueError, match="prompt 'p0' has no reference run"):
        check(history.ops())


def test_the_ledger_never_counts_a_block_twice_and_owes_nothing_at_the_end():
    snapshots = [
        LedgerSnapshot(1.0, (BlockReport("w1", free_blocks=7, total_blocks=10, lent={"w2": 4}),)),
        LedgerSnapshot(2.0, (BlockReport("w1", 5, 10, lent={"w1": 1, "w2": 4}, lend_cap_blocks=4),)),
        LedgerSnapshot(
            3.0, (BlockReport("w1", 8, 10, lent={"w3": 2}), BlockReport("w2", 10, 10, borrowed={"w1": 1}))
        ),
    ]
    verdict = check([], ledger=snapshots)
    assert verdict.ledger == [
        "w1 reports 4 blocks lent + 7 free > 10 in its pool at 1.000 (a block counted twice)",
        "w1 lends 1 blocks to itself at 2.000",
        "w1 lends 5 blocks past its cap of 4 at 2.000",
        "w1 still holds 2 blocks for w3 at the end",
        "w2 still has 1 blocks held by w1 at the end",
    ]
    assert verdict.summary.startswith(
        "0 sent, 0 ok, 0 lost, 0 corrupted, ledger unbalanced; ledger: w1 reports"
    )


def test_a_block_report_reads_the_heartbeat_json():
    load = {"free_blocks": 3, "total_blocks": 8, "lent_blocks": {"w2": 2, "w3": 0}, "lend_cap_blocks": 4}
    report = BlockReport.from_load("w1", load)
    assert (report.free_blocks, report.total_blocks, dict(report.lent), report.lent_total) == (
        3,
        8,
        {"w2": 2},
        2,
    )
    assert report.lend_cap_blocks == 4 and not report.borrowed
    assert BlockReport.from_load("w9", {}).lend_cap_blocks is None


def test_a_deposed_leader_is_fenced():
    terms = [LeaderTerm(5, "kv-a", 0.0), LeaderTerm(9, "kv-b", 10.0)]
    writes = [
        LeaderWrite(1.0, "kv-a", 5, accepted=True),
        LeaderWrite(11.0, "kv-a", 5, accepted=False, what="recall"),  # fenced: as it should be
        LeaderWrite(12.0, "kv-b", 9, accepted=True),
    ]
    verdict = check([], leader_terms=terms, leader_writes=writes)
    assert verdict.holds and verdict.fenced_writes == 1
    broken = check(
        [],
        leader_terms=[*terms, LeaderTerm(9, "kv-c", 10.5)],
        leader_writes=[
            *writes,
            LeaderWrite(13.0, "kv-a", 5, accepted=True, what="recall w1<-w2"),
            LeaderWrite(14.0, "kv-a", 9, accepted=True),
            LeaderWrite(15.0, "kv-a", 7, accepted=True),
        ],
    )
    assert broken.leadership == [
        "term 9 claimed by both kv-b and kv-c",
        "write by kv-a under term 5 accepted at 13.000, after term 9 (kv-b) began: not fenced (recall w1<-w2)",
        "write by kv-a at 14.000 carries term 9, held by kv-b",
        "write by kv-a at 15.000 carries term 7, which no leader took",
    ]


def test_every_service_serves_again_within_the_bound_after_each_heal():
    heals = [
        Heal("f0 partition", healed_at=10.0, serving_at={"gateway": 12.0, "etcd": 9.0}),
        Heal("f1 kill-node", healed_at=20.0, serving_at={"gpu_worker": 55.0, "scheduler": None}),
    ]
    verdict = check([], heals=heals, heal_bound_s=30.0)
    assert verdict.recovery == [
        "gpu_worker served again 35.0 s after f1 kill-node was healed (bound 30 s)",
        "scheduler never served again after f1 kill-node was healed",
    ]
    assert verdict.max_time_to_serving_s == 35.0
    assert check([], heals=heals[:1]).holds
