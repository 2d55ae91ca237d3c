"""How many tokens one request drafts next, from how many of its drafts were accepted.

Whether those tokens are worth their rows in this step is the step-cost model's call
(``draft_cost.py``, at the chance ``acceptance.py`` gives a draft of its match length). A request
it declines would never be verified again, though its output may turn repetitive later:
after ``backoff`` declined steps it drafts one token anyway (a probe), and each probe doubles the
wait for the next, until a draft is accepted.

Verifying a draft costs a row of the step; on a memory-bound decode step that row is nearly
free, but a request whose drafts keep failing only adds work. So ``k`` grows by one after a
draft accepted whole and falls to one past the accepted prefix after a rejection; after
``stop_after_misses`` verifications in a row that accepted nothing, the request stops drafting
for ``backoff_steps`` steps, doubled (up to ``max_backoff_steps``) each time it fails again,
and reset as soon as a draft is accepted: its output may turn repetitive later.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DraftSettings:
    """The drafting knobs of every request (the defaults are the worker's)."""

    max_draft_tokens: int = 5
    """Draft tokens verified per request per step at most (``k``'s ceiling)."""
    max_step_rows: int = 12
    """Decode rows a step may have at most with drafts: its decoding requests' own plus the
    drafts, so a wide batch drafts only for its most accepting requests. The Q4_1 kernel's cost
    is not linear in rows: its register tiles hold 6 rows and from 13 rows it widens W into a
    buffer, and the whole model's matmuls (2 EPYC cores, bf16) measured 1.95x the 1-row time at 6
    rows, 2.83x at 7, 2.96x at 8, 3.76x at 12 but 4.68x at 13: a 13th row costs as much as
    four of those before it, which the linear step-cost model cannot see."""
    max_ngram: int = 3
    """Longest suffix matched against the request's earlier tokens."""
    stop_after_misses: int = 3
    """Verifications in a row that accept nothing before the request pauses drafting."""
    backoff_steps: int = 8
    """Steps of the first pause; each further failed attempt doubles it."""
    max_backoff_steps: int = 256
    """The longest pause."""
    adapter_max_ngram: int = 6
    """``suffix``: longest suffix matched against the adapter's recent outputs (a longer match
    across requests is what makes such a draft worth its rows)."""
    adapter_index_tokens: int = 4096
    """``suffix``: output tokens kept per adapter and tenant namespace."""
    max_adapter_indexes: int = 32
    """``suffix``: adapter and tenant indexes kept, the least recently used dropped first."""
    prior_acceptance: float = 0.5
    """The chance a draft position is accepted, assumed for an adapter none of whose drafts was
    verified yet (``acceptance.DraftChances``)."""
    prior_weight: float = 2.0
    """Draft positions a prior counts for, beside an adapter's (or its match length's) own."""
    verify_step_share: float = 0.02
    """What a step that verifies any draft costs beyond its rows, as a share of a batch-1 step:
    its drafts must together save more. On 2 EPYC cores (Q4_1) the forward pass's first
    verifying row costs no more than the next ones (fp32, batch 1: 6.7 ms with 1 row, 8.2 with 2,
    then +1.7-1.9 ms a row; the kernel alone 1.18x the 1-row time at 2 rows, +0.33x a row after),
    and building a step with drafts costs ~0.1 ms more than a plain one (0.12-0.16 ms against
    0.05): about 2% of a step. It was 0.25 while a verifying step with an adapter rebuilt every
    layer's LoRA segments (+1.2-1.5 ms, and 0.4 ms again on the plain step after it), before the
    step builder kept them per step shape."""
    min_row_share: float = 0.05
    """The least share of a batch-1 step a verifying row is taken to cost, whatever the fitted
    step cost says (quiet, with Q4_1 on 2 EPYC cores, a row measured about 0.07 of a step; on a
    loaded machine the fit's row cost can fall to 0, which would draft everything)."""

    def __post_init__(self) -> None:
        if (
            self.max_draft_tokens < 1
            or self.max_ngram < 1
            or self.stop_after_misses < 1
            or self.max_step_rows < 1
        ):
            raise ValueError(
                "max_draft_tokens, max_ngram, stop_after_misses and max_step_rows must be at least 1, got "
                f"{self.max_draft_tokens}, {self.max_ngram}, {self.stop_after_misses}, {self.max_step_rows}"
            )
        if not 1 <= self.backoff_steps <= self.max_backoff_steps:
            raise ValueError(
                f"backoff_steps must be in [1, max_backoff_steps={self.max_backoff_steps}], got {self.backoff_steps}"
            )


@dataclass
class DraftBudget:
    """One request's ``k`` and its pause, updated after each of its steps."""

    settings: DraftSettings = field(default_factory=DraftSettings)
    k: int = field(init=False)
    """Tokens it drafts at its next step (when not paused)."""
    misses: int = 0
    """Verifications in a row that accepted nothing."""
    paused_steps: int = 0
    """Steps left before it drafts again."""
    backoff: int = field(init=False)
    """The length of its next pause."""
    declined_steps: int = 0
    """Steps since the cost model last let it draft."""

    def __post_init__(self) -> None:
        self.k = self.settings.max_draft_tokens
        self.backoff = self.settings.backoff_steps

    def allowed(self) -> int:
        """Tokens it may draft this step (0 while paused; a paused step counts down)."""
        if self.paused_steps:
            self.paused_steps -= 1
            return 0
        return self.k

    def declined(self) -> bool:
        """The cost model declined its drafts this step; True when it drafts one token anyway
        (its probe, the wait for the next one doubled)."""
        self.declined_steps += 1
        if self.paused_steps or self.declined_steps < self.backoff:
            return False
        self.declined_steps = 0
        self.backoff = min(self.settings.max_backoff_steps, 2 * self.backoff)
        return True

    def verified(self, drafted: int, accepted: int) -> None:
        """``accepted`` of its ``drafted`` tokens (a prefix) were accepted this step."""
        settings = self.settings
        if accepted == drafted:  # a short draft (its match ran out) does not lower k
            self.k = min(settings.max_draft_tokens, max(self.k, drafted + 1))
        else:
            self.k = max(1, accepted + 1)
        if accepted:
            self.misses, self.backoff = 0, settings.backoff_steps
            return
        self.misses += 1
        if self.misses >= settings.stop_after_misses:
            self.misses, self.paused_steps = 0, self.backoff
            self.backoff = min(settings.max_backoff_steps, 2 * self.backoff)
