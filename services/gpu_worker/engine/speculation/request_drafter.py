"""One request's drafting: its n-gram index over its prompt and output, and its budget."""

from __future__ import annotations

from collections.abc import Sequence

from services.gpu_worker.engine.speculation.draft_budget import DraftBudget, DraftSettings
from services.gpu_worker.engine.speculation.ngram_index import NgramIndex


class RequestDrafter:
    """Drafts a request's next tokens from its own tokens, as many as its budget allows."""

    def __init__(self, settings: DraftSettings):
        self.index = NgramIndex(settings.max_ngram)
        self.budget = DraftBudget(settings)

    def propose(self, sequence: Sequence[int], limit: int) -> tuple[int, ...]:
        """Draft tokens to follow ``sequence`` (the request's prompt + output, which only grows),
        ``limit`` at most (what its max_tokens and context leave after the token the step draws
        anyway)."""
        allowed = min(limit, self.budget.allowed())
        if allowed <= 0:
            return ()
        self.index.sync(sequence)
        return self.index.propose(allowed)

    def verified(self, drafted: int, accepted: int) -> None:
        self.budget.verified(drafted, accepted)
