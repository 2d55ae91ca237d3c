"""S-LoRA's first-token metrics (Appendix B) and a fairness index over adapters.

Over *all* requests of a run, with ``t`` a request's first-token latency and ``SLO`` the target:
- attainment: share with ``t ≤ SLO``;
- linear satisfaction: ``max(0, 1 − t/SLO)``;
- quadratic satisfaction (S-LoRA's form): ``1 − (t/SLO)²`` for ``t ≤ SLO``, else 0.
A request that never produced a token (aborted, or still waiting at the window's end) scores 0.
Jain's index over per-adapter mean latencies, ``(Σx)² / (n·Σx²)``, is 1 when every adapter's
requests wait alike and 1/n when one adapter takes all the waiting.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from bench.systems.base import RequestRecord


@dataclass(frozen=True)
class FirstTokenScores:
    slo_s: float
    attainment: float
    linear_satisfaction: float
    quadratic_satisfaction: float
    aborted: int
    """Requests the policy aborted."""

    def to_dict(self) -> dict:
        return asdict(self)


def first_token_latencies(records: Sequence[RequestRecord]) -> list[float | None]:
    """Each request's arrival-to-first-token seconds; None if it never got one."""
    return [None if r.first_token_s is None else r.first_token_s - r.arrival_s for r in records]


def first_token_scores(records: Sequence[RequestRecord], slo_s: float) -> FirstTokenScores:
    if slo_s <= 0:
        raise ValueError(f"slo_s must be positive, got {slo_s}")
    latencies = first_token_latencies(records)
    met = [t for t in latencies if t is not None and t <= slo_s]
    count = max(1, len(records))
    return FirstTokenScores(
        slo_s=slo_s,
        attainment=len(met) / count,
        linear_satisfaction=sum(1 - t / slo_s for t in met) / count,
        quadratic_satisfaction=sum(1 - (t / slo_s) ** 2 for t in met) / count,
        aborted=sum(r.error == "aborted" for r in records),
    )


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index of non-negative values (1.0 for none or all zero)."""
    total, squares = sum(values), sum(v * v for v in values)
    return 1.0 if squares == 0 else total * total / (len(values) * squares)


def per_adapter_mean_latency(records: Sequence[RequestRecord]) -> dict[int, float]:
    """Mean arrival-to-last-token seconds of each adapter's completed requests."""
    by_adapter: dict[int, list[float]] = defaultdict(list)
    for r in records:
        if r.completed:
            by_adapter[r.adapter].append(r.finish_s - r.arrival_s)
    return {adapter: sum(v) / len(v) for adapter, v in sorted(by_adapter.items())}
