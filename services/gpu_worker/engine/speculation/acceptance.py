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
