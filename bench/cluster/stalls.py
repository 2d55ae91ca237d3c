"""What a fault cost the streams in flight when it began: each stream's stall, read from the
per-token arrival times of the history (:attr:`bench.cluster.history.Op.arrived_at`).

A stream's stall is the longest gap between its tokens, its invocation counting as the first
point and its completion as the last (a stream still prefilling when a worker died waits from its
invocation to its first token). Beside it, the gap across the fault's start: from the stream's
last token before it (or its invocation) to its next one, the part of the wait the fault can have
caused (a long prompt's prefill alone can be the longest gap). Only the streams in flight at the fault's start (invoked before it, not completed
before it) that finished ``ok`` are measured: one that failed or timed out has no end to measure
to, and is counted apart. After a node kill this is the failover time a client sees mid-stream:
the gateway continues the stream on another worker (docs/benchmarks.md, "The nemesis over the
overlay pods").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bench.cluster.history import STREAM_KINDS, Op, Outcome


@dataclass(frozen=True)
class Stalls:
    """The streams in flight at one or more moments, and the stalls of those that finished."""

    in_flight: int
    """Streams in flight at the moments."""
    stalls_s: tuple[float, ...]
    """The longest gap of each of them that finished ``ok``, ascending."""
    across_s: tuple[float, ...]
    """The gap across the (first) moment of each of them that finished ``ok``, ascending."""

    def describe(self) -> str:
        """``N streams in flight, M finished: stall p50 X s, p99 Y s (across it p50 X s, p99 Y
        s)``, or fewer words when no stream was in flight or none finished."""
        if not self.in_flight:
            return "no stream in flight"
        head = f"{self.in_flight} streams in flight, {len(self.stalls_s)} finished"
        if not self.stalls_s:
            return head
        return (
            f"{head}: stall p50 {percentile(self.stalls_s, 0.5):.1f} s, p99 {percentile(self.stalls_s, 0.99):.1f} s"
            f" (across it p50 {percentile(self.across_s, 0.5):.1f} s, p99 {percentile(self.across_s, 0.99):.1f} s)"
        )


def percentile(ascending: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1): with fewer than 100 values the p99 is the
    largest."""
    if not ascending:
        raise ValueError("no values to take a percentile of")
    return ascending[max(0, math.ceil(q * len(ascending)) - 1)]


def _points(op: Op) -> list[float]:
    return [op.invoked_at, *op.arrived_at, *([op.completed_at] if op.completed_at is not None else [])]


def longest_gap(op: Op) -> float:
    """The longest wait between consecutive tokens of ``op``, from its invocation to its end."""
    points = _points(op)
    return max((b - a for a, b in itertools.pairwise(points)), default=0.0)


def gap_across(op: Op, moment: float) -> float:
    """The wait of ``op`` that spans ``moment``: from its last point at or before it to its
    first after it."""
    points = _points(op)
    return min(t for t in points if t > moment) - max(t for t in points if t <= moment)


def in_flight_at(op: Op, moment: float) -> bool:
    return op.invoked_at < moment and (op.completed_at is None or op.completed_at > moment)


def stalls_at(ops: Iterable[Op], moments: Sequence[float]) -> Stalls:
    """The streams of ``ops`` in flight at any of ``moments`` (each counted once, at the first),
    and the stalls of those that finished ``ok``."""
    caught: list[tuple[Op, float]] = []
    for op in ops:
        at = (
            next((m for m in sorted(moments) if in_flight_at(op, m)), None)
            if op.kind in STREAM_KINDS
            else None
        )
        if at is not None:
            caught.append((op, at))
    finished = [(op, at) for op, at in caught if op.outcome == Outcome.OK]
    return Stalls(
        len(caught),
        tuple(sorted(longest_gap(op) for op, _ in finished)),
        tuple(sorted(gap_across(op, at) for op, at in finished)),
    )
