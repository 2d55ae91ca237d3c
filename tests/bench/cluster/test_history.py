"""The nemesis history: recorded from threads and asyncio tasks at once, read back from JSONL."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest

from bench.cluster.history import History, Op, OpKind, Outcome, Sampling, StreamRecord


def ticking_clock():
    ticks = itertools.count()
    return lambda: float(next(ticks))


def test_an_operation_is_invoked_then_completed_on_the_history_clock():
    history = History(clock=ticking_clock())
    op_id = history.invoke("c1", OpKind.UPLOAD, "a1", digest="ab" * 32)
    assert history.ops()[op_id].outcome is None
    assert history.ops()[op_id].final_outcome == Outcome.INFO
    done = history.complete(op_id, Outcome.OK)
    assert (done.invoked_at, done.completed_at, done.outcome, done.digest) == (
        0.0,
        1.0,
        Outcome.OK,
        "ab" * 32,
    )
    with pytest.raises(ValueError, match="completed twice"):
        history.complete(op_id, Outcome.FAIL)


def test_a_stream_record_numbers_tokens_and_marks_resumes():
    stream = StreamRecord()
    stream.received([5, 6], at=1.5)
    stream.resumed()
    stream.received([7], at=4.0)
    stream.finish_reason = "length"
    assert stream.payload() == {
        "tokens": ((0, 5), (1, 6), (2, 7)),
        "resumed_at": (2,),
        "arrived_at": (1.5, 1.5, 4.0),  # one time a token: a message's tokens share its arrival
        "finish_reason": "length",
    }


def test_the_history_round_trips_through_jsonl(tmp_path):
    history = History(clock=ticking_clock())
    up = history.invoke("c1", OpKind.UPLOAD, "a1", digest="d1")
    history.complete(up, Outcome.INFO, error="UNAVAILABLE: replica gone")
    ls = history.invoke("c2", OpKind.LIST, "")
    history.complete(ls, Outcome.OK, names=("a1", "a2"))
    stream = StreamRecord()
    stream.received([1, 2], at=2.25)
    stream.received([3], at=2.75)
    stream.finish_reason = "stop"
    gen = history.invoke("c3", OpKind.GENERATE_STREAM, "p0", sampling=Sampling.GREEDY)
    history.complete(gen, Outcome.OK, **stream.payload())
    history.invoke("c4", OpKind.BORROW, "p1")  # never completed
    path = tmp_path / "history.jsonl"
    history.write_jsonl(path)
    assert History.read_jsonl(path) == history.ops()
    # Defaults are left out of the lines: a listing's line has no tokens, a pending one no outcome.
    assert "tokens" not in path.read_text().splitlines()[1]
    assert "outcome" not in path.read_text().splitlines()[3]


async def test_threads_and_tasks_record_into_one_history():
    history = History()

    def client(name: str) -> None:
        for i in range(200):
            history.complete(history.invoke(name, OpKind.FETCH, f"a{i}"), Outcome.OK, digest="d")

    async def task(name: str) -> None:
        for i in range(200):
            op = history.invoke(name, OpKind.FETCH, f"a{i}")
            await asyncio.sleep(0)
            history.complete(op, Outcome.OK, digest="d")

    threads = [threading.Thread(target=client, args=(f"t{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    await asyncio.gather(*(task(f"a{i}") for i in range(4)))
    for thread in threads:
        thread.join()
    ops = history.ops()
    assert len(ops) == 1600 and [op.id for op in ops] == list(range(1600))
    assert all(op.outcome == Outcome.OK for op in ops)


def test_an_op_line_names_its_kind_and_outcome_as_words():
    line = Op(3, "c", OpKind.GENERATE_STREAM, "p", 1.5, 2.5, Outcome.FAIL, error="x").to_json()
    assert '"kind":"generate-stream"' in line and '"outcome":"fail"' in line
