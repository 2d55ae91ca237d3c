"""One request's drafting: its n-gram index over its prompt and output, its adapter's recent
outputs (``speculative: suffix``), its budget, and what its drafts are worth (``draft_cost.py``,
at their match length's chance, ``acceptance.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.gpu_worker.engine.speculation.adapter_output_index import AdapterOutputIndex
from services.gpu_worker.engine.speculation.draft_budget import DraftBudget, DraftSettings
from services.gpu_worker.engine.speculation.draft_cost import DraftPrices
from services.gpu_worker.engine.speculation.ngram_index import NgramIndex


class RequestDrafter:
    """Drafts a request's next tokens from its own tokens, and with an adapter index from its
    adapter's recent outputs too, as many as its budget allows."""

    def __init__(self, settings: DraftSettings, adapter_index: AdapterOutputIndex | None = None):
        self.index = NgramIndex(settings.max_ngram)
        self.budget = DraftBudget(settings)
        self.adapter_index = adapter_index
        self.probing = False
        """Its last proposal is its probe: one token drafted though its drafts do not pay."""
        self.match_length = 0
        """The length of the suffix its last proposal matched (0: it proposed nothing)."""
        self.chance = 0.0
        """The chance each position of its last proposal is accepted."""

    def propose(
        self,
        sequence: Sequence[int],
        limit: int,
        prices: DraftPrices | None = None,
        chance: Callable[[int], float] | None = None,
    ) -> tuple[int, ...]:
        """Draft tokens to follow ``sequence`` (the request's prompt + output, which only grows),
        ``limit`` at most (what its max_tokens and context leave after the token the step draws
        anyway): from whichever source matched the longer suffix, its own tokens on a tie. With
        ``prices``, only as many as pay for their rows at ``chance(n)``, the chance each position
        of a draft matched on ``n`` tokens is accepted (the settings' prior without it), or its
        probe."""
        allowed = min(limit, self.budget.allowed())
        self.probing = False
        self.match_length = 0
        if allowed <= 0:
            return ()
        self.index.sync(sequence)
        n, drafts = self.index.match(allowed)
        if self.adapter_index is not None and n < self.adapter_index.max_ngram:
            shared_n, shared = self.adapter_index.match(self.index.tokens, allowed)
            if shared_n > n:
                n, drafts = shared_n, shared
        if not drafts:
            return ()
        self.match_length = n
        self.chance = self.budget.settings.prior_acceptance if chance is None else chance(n)
        if prices is None:
            return drafts
        worth = prices.worth(self.chance, len(drafts))
        if worth == 0:
            if not self.budget.declined():
                return ()
            worth = self.probing = 1  # its probe: its output may have turned repetitive since
        return drafts[:worth]

    def verified(self, drafted: int, accepted: int) -> None:
        self.budget.verified(drafted, accepted)
