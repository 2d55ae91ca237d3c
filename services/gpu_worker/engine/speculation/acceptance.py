"""How likely a draft's tokens are to be accepted, from the verifications before it.

A verification that accepted ``a`` of ``d`` drafted tokens tried ``a`` positions that matched and,
when ``a < d``, one that did not (the positions after a miss are never tried). Their ratio is
the chance that one more draft position is accepted, the geometric model's ``p``: ``k`` drafts
yield ``p + p² + … + pᵏ`` accepted tokens on average. Counts decay per verification, so a rate
follows what its drafts lately were.

What tells most is the length of the suffix a draft matched (``DraftChances``): on the bench's
workloads a draft matched on 3 tokens had its first token accepted 94% of the time, on 1 token
27%, whatever the request. Priced by its match length instead of by its request's recent
acceptance, the exact replay (``bench.speculative_policy_sim``, a row at 0.17 of a batch-1 step)
decoded 2.01 tokens a step on the repetitive workload against 1.91, the quick trace 1.52 against
1.31.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

MATCH_LENGTHS_KEPT = 8
"""Match lengths whose rates :class:`DraftChances` keeps per adapter (its bound)."""


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


class KeyedRates:
    """An :class:`AcceptanceRate` per key, the ``max_keys`` most recently verified kept."""

    def __init__(self, decay: float, max_keys: int):
        self.decay = decay
        self.max_keys = max_keys
        self._rates: dict[Hashable, AcceptanceRate] = {}
        """By key, the least recently verified first."""

    def rate(self, key: Hashable, prior: float, prior_weight: float) -> float:
        """``key``'s chance that a draft position is accepted (``prior`` before any verification)."""
        rate = self._rates.get(key)
        return prior if rate is None else rate.rate(prior, prior_weight)

    def verified(self, key: Hashable, drafted: int, accepted: int) -> None:
        rate = self._rates.pop(key, None) or AcceptanceRate(self.decay)
        rate.verified(drafted, accepted)
        self._rates[key] = rate
        if len(self._rates) > self.max_keys:
            del self._rates[next(iter(self._rates))]

    def keys(self) -> list[Hashable]:
        return list(self._rates)


class DraftChances:
    """The chance each position of a draft is accepted, per adapter and length of the suffix the
    draft matched; an adapter's rate over all its drafts is its match lengths' prior, and the
    settings' prior is an adapter's before any of its drafts was verified."""

    def __init__(self, prior: float, prior_weight: float, decay: float, max_adapters: int):
        """``prior`` counts ``prior_weight`` tried positions; counts decay by ``decay`` per
        verification; the ``max_adapters`` most recently verified adapters are kept."""
        self.prior = prior
        self.prior_weight = prior_weight
        self.adapters = KeyedRates(decay, max_adapters)
        self.matches = KeyedRates(decay, MATCH_LENGTHS_KEPT * max_adapters)

    def adapter(self, adapter: str) -> float:
        """``adapter``'s chance over all its drafts."""
        return self.adapters.rate(adapter, self.prior, self.prior_weight)

    def match(self, adapter: str, length: int) -> float:
        """The chance for a draft of ``adapter`` that matched a suffix of ``length`` tokens."""
        return self.matches.rate((adapter, length), self.adapter(adapter), self.prior_weight)

    def verified(self, adapter: str, length: int, drafted: int, accepted: int) -> None:
        """``accepted`` of a draft's ``drafted`` tokens (a prefix), matched on ``length``, were accepted."""
        self.adapters.verified(adapter, drafted, accepted)
        self.matches.verified((adapter, length), drafted, accepted)
