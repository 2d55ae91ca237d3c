"""Label values of an unbounded dimension (adapters), capped for Prometheus.

A series per adapter is what operators want for the few adapters that carry the traffic, and what
swamps Prometheus at 10,000 adapters (each label value is a series of its own, on every worker,
for every per-adapter metric). So every per-adapter series names its top ``cap`` adapters by
request count, and sums the rest under :data:`OTHER`, one place deciding for all of them, so that
the series of one scrape agree on who is named.

Ranked per scrape: an adapter that climbs into the top ``cap`` takes its own label from then on,
and what it had counted under ``other`` leaves ``other`` (a counter there may step down once,
which Prometheus's ``rate`` reads as a reset). Pure: no clock, no Prometheus.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping

OTHER = "other"
"""The label value of the adapters past the cap (store adapters are named ``owner/name``, so no
adapter of the store can be named this)."""
DEFAULT_CAP = 50
"""Adapters named per per-adapter series by default."""


class CappedLabels:
    """The label of each name of one scrape: itself when among the top ``cap`` by request count
    (ties by name), else :data:`OTHER`. Every name keeps its own label while there are at most
    ``cap`` of them."""

    def __init__(self, names: Iterable[str], requests: Mapping[str, int], cap: int = DEFAULT_CAP):
        """``names``: every name the scrape's series hold; ``requests``: requests per name so
        far (missing: none)."""
        if cap < 1:
            raise ValueError(f"the adapter label cap must be at least 1, got {cap}")
        self._named = frozenset(
            heapq.nsmallest(cap, set(names), key=lambda name: (-requests.get(name, 0), name))
        )

    def __call__(self, name: str) -> str:
        return name if name in self._named else OTHER

    def sum(self, values: Mapping[str, int]) -> dict[str, int]:
        """``values`` per name summed per label."""
        summed: dict[str, int] = {}
        for name, value in values.items():
            label = self(name)
            summed[label] = summed.get(label, 0) + value
        return summed
