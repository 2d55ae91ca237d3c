"""What a fault cost the streams in flight: each one's longest gap between tokens (from its
invocation to its end) and the gap across the fault, read from the history's per-token times."""

from __future__ import annotations

import pytest

from bench.cluster.history import Op, OpKind, Outcome
from bench.cluster.stalls import gap_across, longest_gap, percentile, stalls_at


def stream(invoked: float, arrivals: list[float], completed: float | None, outcome=Outcome.OK, kind=OpKind.GENERATE_STREAM) -> Op:  # fmt: skip
    return Op(0, "c", kind, "p", invoked, completed, outcome if completed is not None else None,
              tokens=tuple((i, 7) for i in range(len(arrivals))), arrived_at=tuple(arrivals))  # fmt: skip


def test_a_streams_longest_gap_counts_its_invocation_and_its_end():
    assert longest_gap(stream(0.0, [1.0, 1.5, 9.5, 10.0], 10.5)) == 8.0
    assert longest_gap(stream(0.0, [6.0, 6.5], 7.0)) == 6.0  # waited for its first token
    assert longest_gap(stream(0.0, [1.0], 4.0)) == 3.0  # its end came late
    assert gap_across(stream(0.0, [1.0, 1.5, 9.5, 10.0], 10.5), 5.0) == 8.0
    assert gap_across(stream(0.0, [6.0, 6.5], 7.0), 5.0) == 6.0


def test_only_streams_in_flight_at_the_fault_are_caught_and_only_finished_ones_measured():
    kill = 10.0
    ops = [
        stream(9.0, [9.5, 14.5, 15.0], 15.5),  # caught: 5 s across the kill
        stream(8.0, [8.2, 8.4, 11.4], 12.0, kind=OpKind.BORROW),  # caught: 3 s
        stream(9.9, [], 40.0, Outcome.INFO),  # caught, timed out: counted, not measured
        stream(1.0, [2.0, 3.0], 9.0),  # done before the kill
        stream(11.0, [20.0], 21.0),  # invoked after it
        Op(1, "u", OpKind.UPLOAD, "a", 9.0, 12.0, Outcome.OK),  # not a stream
    ]
    stalls = stalls_at(ops, [kill])
    assert (stalls.in_flight, stalls.stalls_s, stalls.across_s) == (3, (3.0, 5.0), (3.0, 5.0))
    assert stalls.describe() == (
        "3 streams in flight, 2 finished: stall p50 3.0 s, p99 5.0 s (across it p50 3.0 s, p99 5.0 s)"
    )
    # Several kills: a stream in flight across two is counted once, at the first.
    both = stalls_at([stream(9.0, [9.5, 30.0], 31.0)], [kill, 20.0])
    assert (both.in_flight, both.across_s) == (1, (20.5,))
    assert stalls_at(ops, [100.0]).describe() == "no stream in flight"


def test_percentiles_are_nearest_rank():
    values = tuple(float(v) for v in range(1, 11))
    assert (percentile(values, 0.5), percentile(values, 0.99), percentile(values, 0.1)) == (5.0, 10.0, 1.0)
    with pytest.raises(ValueError, match="no values"):
        percentile((), 0.5)
