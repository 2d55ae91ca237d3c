"""One request's drafting: its n-gram index over its prompt and output, its adapter's recent
outputs (``speculative: suffix``), and its budget."""

from __future__ import annotations

from collections.abc import Sequence

from services.gpu_worker.engine.speculation.adapter_output_index import AdapterOutputIndex
from services.gpu_worker.engine.speculation.draft_budget import DraftBudget, DraftSettings
from services.gpu_worker.engine.speculation.ngram_index import NgramIndex


class RequestDrafter:
    """Drafts a request's next tokens from its own tokens, and with an adapter index from its
    adapter's recent outputs too, as many as its budget allows."""

    def __init__(self, settings: DraftSettings, adapter_index: AdapterOutputIndex | None = None):
        self.index = NgramIndex(settings.max_ngram)
        self.budget = DraftBudget(settings)
        self.adapter_index = adapter_index

    def propose(self, sequence: Sequence[int], limit: int) -> tuple[int, ...]:
        """Draft tokens to follow ``sequence`` (the request's prompt + output, which only grows),
        ``limit`` at most (what its max_tokens and context leave after the token the step draws
        anyway): from whichever source matched the longer suffix, its own tokens on a tie."""
        allowed = min(limit, self.budget.allowed())
        if allowed <= 0:
            return ()
        self.index.sync(sequence)
        n, drafts = self.index.match(allowed)
        if self.adapter_index is not None and n < self.adapter_index.max_ngram:
            shared_n, shared = self.adapter_index.match(self.index.tokens, allowed)
            if shared_n > n:
                return shared
        return drafts

    def verified(self, drafted: int, accepted: int) -> None:
        self.budget.verified(drafted, accepted)
