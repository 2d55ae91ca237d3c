"""How likely a request's next draft token is to be accepted, from its recent verifications.

A verification that accepted ``a`` of ``d`` drafted tokens tried ``a`` positions that matched and,
when ``a < d``, one that did not (the positions after a miss are never tried). Their ratio is
the chance that one more draft position is accepted, the geometric model's ``p``: ``k`` drafts
yield ``p + p² + … + pᵏ`` accepted tokens on average. Counts decay per verification, so the rate
follows a request whose output turns repetitive, or stops being so.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AcceptanceRate:
    """Decayed counts of accepted and tried draft positions."""

    decay: float = 0.8
    """Weight each earlier verification keeps when a new one is counted (0 < decay ≤ 1)."""
    accepted: float = 0.0
    tried: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")

    def verified(self, drafted: int, accepted: int) -> None:
        """``accepted`` of ``drafted`` tokens (a prefix) were accepted."""
        self.accepted = self.decay * self.accepted + accepted
        self.tried = self.decay * self.tried + accepted + (1 if accepted < drafted else 0)

    def rate(self, prior: float, prior_weight: float) -> float:
        """The chance one more position is accepted: these counts with ``prior_weight`` tried
        positions at ``prior`` added (the prior alone before any verification)."""
        return (self.accepted + prior_weight * prior) / (self.tried + prior_weight)


class AdapterRates:
    """Each adapter's :class:`AcceptanceRate` (a new request's prior), the ``max_adapters``
    most recently verified kept."""

    def __init__(self, decay: float, max_adapters: int):
        self.decay = decay
        self.max_adapters = max_adapters
        self._rates: dict[str, AcceptanceRate] = {}
        """By adapter key, the least recently verified first."""

    def rate(self, key: str, prior: float, prior_weight: float) -> float:
        """``key``'s chance that a draft position is accepted (``prior`` before any verification)."""
        rate = self._rates.get(key)
        return prior if rate is None else rate.rate(prior, prior_weight)

    def verified(self, key: str, drafted: int, accepted: int) -> None:
        rate = self._rates.pop(key, None) or AcceptanceRate(self.decay)
        rate.verified(drafted, accepted)
        self._rates[key] = rate
        if len(self._rates) > self.max_adapters:
            del self._rates[next(iter(self._rates))]

    def keys(self) -> list[str]:
        return list(self._rates)
