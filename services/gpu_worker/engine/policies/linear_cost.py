"""The step-cost model: a cost linear in named terms, fitted by least squares.

``cost ≈ Σ coefficient · term``, the first term the intercept (its feature is always 1). Each user
names its terms and computes a step's (or batch's) features in that order: the engine's batch
policies over prefill and decode tokens and adapters (``step_cost_model.py``, fitted online, in
seconds), the cluster simulator over a step's shape (``bench/cluster_sim/cost_model.py``, fitted
offline by its calibration, in ms), Magnus' static batches over the batch's shape
(``bench/magnus/batch_time.py``, fitted online, in seconds).

Two fits, one model (:meth:`LinearCost.fit`):

- least squares with priors (the default), for a window of recent steps that may not vary every
  term: a term whose feature did not vary keeps its prior, a ``confounded`` term that the other
  terms explain counts 0, slopes are clamped at 0 and the intercept may go negative to absorb
  them;
- non-negative least squares (``nonnegative``), for a grid or history that varies every term:
  every coefficient is a cost, so none is negative.

:class:`OnlineFit` refits a :class:`LinearCost` as observations arrive.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np


@dataclass(frozen=True)
class LinearCost:
    """Coefficients of named terms; the first term is the intercept."""

    terms: tuple[str, ...]
    coefficients: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.terms) != len(self.coefficients):
            raise ValueError(f"{len(self.terms)} terms but {len(self.coefficients)} coefficients")

    @classmethod
    def named(cls, terms: Sequence[str], **coefficients: float) -> LinearCost:
        """The cost over ``terms`` with these coefficients, the ones not given 0."""
        unknown = set(coefficients) - set(terms)
        if unknown:
            raise ValueError(f"no such terms: {sorted(unknown)} (terms: {list(terms)})")
        return cls(tuple(terms), tuple(float(coefficients.get(t, 0.0)) for t in terms))

    def __getitem__(self, term: str) -> float:
        return self.coefficients[self.terms.index(term)]

    def as_dict(self) -> dict[str, float]:
        return dict(zip(self.terms, self.coefficients, strict=True))

    def predict(self, features: Sequence[float]) -> float:
        """The cost of features given in the order of :attr:`terms` (never below zero)."""
        return max(0.0, sum(c * f for c, f in zip(self.coefficients, features, strict=True)))

    def fit(
        self,
        rows: Iterable[Sequence[float]],
        targets: Iterable[float],
        *,
        nonnegative: bool = False,
        confounded: tuple[str, ...] = (),
    ) -> LinearCost:
        """The cost fitted on ``rows`` of features (in the order of :attr:`terms`, the first
        always 1) and their measured ``targets``.

        ``nonnegative``: non-negative least squares over every term (this cost is not used).
        Otherwise least squares with this cost as the prior: a term whose feature does not vary
        over the rows cannot be told apart from the intercept, so it keeps its coefficient here,
        and the intercept (which may go negative to absorb it) and the other terms are fitted;
        a term of ``confounded`` that the other varied terms explain (its feature moves with
        theirs, R² ≥ :data:`COLLINEAR_R2`) counts 0 and they take its cost, since a fit would
        split the cost between them at random. Slopes are never negative.
        """
        x = np.array(list(rows), dtype=np.float64).reshape(-1, len(self.terms))
        y = np.array(list(targets), dtype=np.float64)
        if nonnegative:
            # scipy here, not at the top: the policies' registry is imported by configs and the CLI
            from scipy.optimize import nnls

            coef, _ = nnls(x, y)
            return LinearCost(self.terms, tuple(float(c) for c in coef))
        prior = np.array(self.coefficients, dtype=np.float64)
        varied = np.array([True, *(np.ptp(x[:, i]) > 0 for i in range(1, len(self.terms)))])
        for term in confounded:
            i = self.terms.index(term)
            others = varied.copy()
            others[i] = False
            if varied[i] and _explained(x[:, i], x[:, others]):
                varied[i], prior[i] = False, 0.0
        target = y - x[:, ~varied] @ prior[~varied]
        coef, *_ = np.linalg.lstsq(x[:, varied], target, rcond=None)
        fitted = prior.copy()
        fitted[varied] = coef
        fitted[1:] = np.maximum(fitted[1:], 0.0)
        return LinearCost(self.terms, tuple(float(c) for c in fitted))


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


@dataclass(frozen=True)
class FitConfig:
    """How an :class:`OnlineFit` learns."""

    window: int | None = None
    """Observations the fit looks at (the most recent ones); None: all of them."""
    min_rows: int = 1
    """Observations needed before the fit replaces the prior."""
    refit_every: int = 1
    """Observations between two refits."""
    nonnegative: bool = False
    """Non-negative least squares (see :meth:`LinearCost.fit`)."""
    confounded: tuple[str, ...] = ()
    """Terms not fitted when the others explain them (see :meth:`LinearCost.fit`)."""


T = TypeVar("T")


class OnlineFit(Generic[T]):
    """A :class:`LinearCost` over ``terms``, refitted from the observations it is shown.

    ``features`` turns an observation into its row of features and measured cost, or None for
    one the model does not learn from. Until ``config.min_rows`` rows were seen the prior answers
    (without one, :attr:`cost` raises)."""

    def __init__(
        self,
        terms: Sequence[str],
        features: Callable[[T], tuple[Sequence[float], float] | None],
        config: FitConfig = FitConfig(),
        prior: LinearCost | None = None,
    ):
        if prior is not None and prior.terms != tuple(terms):
            raise ValueError(f"the prior's terms {prior.terms} are not {tuple(terms)}")
        self.terms = tuple(terms)
        self.features = features
        self.config = config
        self.fitted = False
        """Whether :attr:`cost` comes from a fit (rather than the prior)."""
        self._cost = prior
        self._rows: deque[tuple[float, ...]] = deque(maxlen=config.window)
        self._targets: deque[float] = deque(maxlen=config.window)
        self._since_fit = 0

    @property
    def cost(self) -> LinearCost:
        if self._cost is None:
            raise RuntimeError(
                f"the cost model has seen no observation to fit ({len(self._rows)} of "
                f"{self.config.min_rows}) and has no prior"
            )
        return self._cost

    def observe(self, observation: T) -> None:
        sample = self.features(observation)
        if sample is None:
            return
        row, target = sample
        self._rows.append(tuple(row))
        self._targets.append(target)
        self._since_fit += 1
        if len(self._rows) >= self.config.min_rows and self._since_fit >= self.config.refit_every:
            self._since_fit = 0
            prior = self._cost or LinearCost.named(self.terms)
            self._cost = prior.fit(
                self._rows,
                self._targets,
                nonnegative=self.config.nonnegative,
                confounded=self.config.confounded,
            )
            self.fitted = True
