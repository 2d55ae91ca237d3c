"""Histograms and counters with an ``adapter`` label whose values are capped at scrape time.

``prometheus_client``'s labelled metrics keep a child per label value for ever and cannot merge
children, so a per-adapter histogram would hold a series set per adapter ever served (10,000
adapters times the buckets). These keep their counts per adapter and emit them through a
:class:`~services.runtime.capped_labels.CappedLabels` of the scrape: the top adapters by requests
under their own names, the rest summed under ``other`` (bucket by bucket for a histogram, which
stays a valid histogram). Pure: no clock, no registry; the caller's collector yields
:meth:`family` once per scrape.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from services.runtime.capped_labels import CappedLabels

ADAPTER = "adapter"
"""The capped label's name."""


@dataclass
class _Counts:
    """One series of a histogram: observations per bucket (not cumulative; the last is +Inf)."""

    buckets: list[int]
    total: float = 0.0

    def add(self, other: _Counts) -> None:
        self.buckets = [a + b for a, b in zip(self.buckets, other.buckets, strict=True)]
        self.total += other.total


@dataclass
class CappedHistogram:
    """A histogram per (adapter, the values of ``labels``)."""

    name: str
    documentation: str
    labels: tuple[str, ...]
    """The labels after ``adapter``, e.g. ``("tenant",)``."""
    bounds: Sequence[float]
    """The buckets' upper bounds, ascending (+Inf is added)."""
    _series: dict[tuple[str, ...], _Counts] = field(default_factory=dict)

    def observe(self, adapter: str, values: tuple[str, ...], seconds: float, times: int = 1) -> None:
        """``times`` observations of ``seconds`` (several tokens of one message share its gap)."""
        counts = self._series.get((adapter, *values))
        if counts is None:
            counts = self._series[(adapter, *values)] = _Counts([0] * (len(self.bounds) + 1))
        counts.buckets[bisect.bisect_left(self.bounds, seconds)] += times
        counts.total += seconds * times

    def adapters(self) -> set[str]:
        return {key[0] for key in self._series}

    def family(self, capped: CappedLabels, fixed: dict[str, str]) -> HistogramMetricFamily:
        """The histogram with ``fixed`` labels first (e.g. ``model_name``), adapters capped."""
        merged: dict[tuple[str, ...], _Counts] = {}
        for (adapter, *values), counts in self._series.items():
            key = (capped(adapter), *values)
            into = merged.setdefault(key, _Counts([0] * len(counts.buckets)))
            into.add(counts)
        family = HistogramMetricFamily(self.name, self.documentation, labels=[*fixed, ADAPTER, *self.labels])
        edges = [*(_bound(b) for b in self.bounds), "+Inf"]
        for key, counts in sorted(merged.items()):
            cumulative, running = [], 0
            for edge, count in zip(edges, counts.buckets, strict=True):
                running += count
                cumulative.append((edge, running))
            family.add_metric([*fixed.values(), *key], cumulative, counts.total)
        return family


@dataclass
class CappedCounter:
    """A counter per (adapter, the values of ``labels``)."""

    name: str
    """Without ``_total`` (the exposition adds it)."""
    documentation: str
    labels: tuple[str, ...]
    _series: dict[tuple[str, ...], float] = field(default_factory=dict)

    def inc(self, adapter: str, values: tuple[str, ...], amount: float = 1) -> None:
        key = (adapter, *values)
        self._series[key] = self._series.get(key, 0) + amount

    def adapters(self) -> set[str]:
        return {key[0] for key in self._series}

    def family(self, capped: CappedLabels, fixed: dict[str, str]) -> CounterMetricFamily:
        merged: dict[tuple[str, ...], float] = {}
        for (adapter, *values), value in self._series.items():
            key = (capped(adapter), *values)
            merged[key] = merged.get(key, 0) + value
        family = CounterMetricFamily(self.name, self.documentation, labels=[*fixed, ADAPTER, *self.labels])
        for key, value in sorted(merged.items()):
            family.add_metric([*fixed.values(), *key], value)
        return family


def _bound(bound: float) -> str:
    """A bucket's ``le`` as prometheus_client writes it (``0.5``, ``1.0``)."""
    return "+Inf" if math.isinf(bound) else repr(float(bound))
