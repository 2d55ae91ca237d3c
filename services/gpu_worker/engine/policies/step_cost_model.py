"""A step's cost, fitted online from measured steps (PetS's α/β latency model, SEED-SPECS §4).

``seconds ≈ fixed + per_prefill_token·prefill + per_decode_token·decode + per_adapter·adapters``

``fixed`` and the token terms are the shared (α) part; ``per_adapter`` is the adapter (β) part
that grows with the number of distinct adapters in the step. Fitted by least squares over the
last ``window`` unmerged steps, refitted every ``refit_every`` observations; until enough steps
were seen the prior (measured once on this CPU) answers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from services.gpu_worker.engine.policies.batch_policy import StepOutcome, Unmerged


@dataclass(frozen=True)
class StepCost:
    """Coefficients of the step cost model, in seconds."""

    fixed: float
    per_prefill_token: float
    per_decode_token: float
    per_adapter: float

    def seconds(self, prefill_tokens: int, decode_tokens: int, adapters: int) -> float:
        return max(
            0.0,
            self.fixed
            + self.per_prefill_token * prefill_tokens
            + self.per_decode_token * decode_tokens
            + self.per_adapter * adapters,
        )


DEFAULT_PRIOR = StepCost(fixed=0.02, per_prefill_token=0.0005, per_decode_token=0.002, per_adapter=0.001)
"""SmolLM2-135M fp32 on 2 AVX2 cores, rounded; only used until the model has seen steps."""


@dataclass(frozen=True)
class StepCostConfig:
    """How the cost model learns."""

    window: int = 256
    """Steps the fit looks at (the most recent ones)."""
    min_steps: int = 16
    """Steps needed before the fit replaces the prior."""
    refit_every: int = 16
    """Observations between two refits."""


class StepCostModel:
    """The fitted :class:`StepCost` of unmerged steps."""

    def __init__(self, config: StepCostConfig = StepCostConfig(), prior: StepCost = DEFAULT_PRIOR):
        self.config = config
        self.cost = prior
        self._rows: deque[tuple[int, int, int, float]] = deque(maxlen=config.window)
        self._since_fit = 0

    def observe(self, outcome: StepOutcome) -> None:
        if not isinstance(outcome.mode, Unmerged):
            return
        self._rows.append((outcome.prefill_tokens, outcome.decode_tokens, outcome.adapters, outcome.seconds))
        self._since_fit += 1
        if len(self._rows) >= self.config.min_steps and self._since_fit >= self.config.refit_every:
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        rows = np.array(self._rows, dtype=np.float64)
        terms = np.column_stack([np.ones(len(rows)), rows[:, :3]])
        prior = np.array(
            [self.cost.fixed, self.cost.per_prefill_token, self.cost.per_decode_token, self.cost.per_adapter]
        )
        # A term the recent steps do not vary (e.g. no prefill seen) cannot be told apart from
        # the fixed cost: it keeps its prior value, and the fixed cost (the intercept, which may
        # go negative to absorb it) and the other terms are fitted. Slopes are never negative.
        varied = np.array([True, *(np.ptp(terms[:, i]) > 0 for i in range(1, 4))])
        # Nor can the adapter term be told from the token terms when the adapter count moves with
        # them (every request a different adapter: adapters = decodes in every step); a fit would
        # split the per-request cost between them at random. Then it counts 0 and the token terms
        # take its cost, which predicts such steps right and claims no adapter cost unseen.
        if varied[3] and _explained(terms[:, 3], terms[:, varied[:3].nonzero()[0]]):
            varied[3], prior[3] = False, 0.0
        target = rows[:, 3] - terms[:, ~varied] @ prior[~varied]
        coef, *_ = np.linalg.lstsq(terms[:, varied], target, rcond=None)
        fitted = prior.copy()
        fitted[varied] = coef
        fitted[1:] = np.maximum(fitted[1:], 0.0)
        self.cost = StepCost(*(float(c) for c in fitted))


COLLINEAR_R2 = 0.95
"""A column this well explained (R²) by the others' least-squares combination is not fitted."""


def _explained(column: np.ndarray, others: np.ndarray) -> bool:
    """Whether ``column`` is (nearly) a linear combination of the ``others`` columns."""
    spread = np.sum((column - column.mean()) ** 2)
    if spread == 0:
        return True
    coef, *_ = np.linalg.lstsq(others, column, rcond=None)
    residual = np.sum((column - others @ coef) ** 2)
    return 1 - residual / spread >= COLLINEAR_R2
