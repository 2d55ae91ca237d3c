"""Magnus' batch-time estimator for static batches (SEED-SPECS §3 step 3), fitted from measured
batches.

A static batch of ``bs`` requests prefills them (``bs·L`` tokens, L the longest prompt) and then
decodes ``G`` steps (G the longest output: the batch ends with its longest request), each step
attending over a context that grows from L to L + G:

``T(bs, L, G) = a + b·bs·L + G·(c + d·bs + e·bs·(L + G/2))``

Magnus fits a KNN regressor on (bs, L, G); on a CPU with a few dozen measured batches a KNN
cannot extrapolate to sizes it has not seen, so the same inputs go into this cost form, fitted by
non-negative least squares (every term is a cost). Refitted after each observed batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls


@dataclass(frozen=True)
class BatchShape:
    """What the estimator sees of a static batch."""

    size: int
    """Requests in the batch (bs)."""
    prompt_tokens: int
    """The longest prompt, L(B)."""
    output_tokens: int
    """The longest output, G(B) (predicted before it runs, measured after)."""


def _terms(shape: BatchShape) -> np.ndarray:
    bs, prompt, out = shape.size, shape.prompt_tokens, shape.output_tokens
    return np.array([1.0, bs * prompt, out, out * bs, out * bs * (prompt + out / 2)], dtype=np.float64)


class BatchTimeEstimator:
    """Seconds a static batch takes, fitted from the batches measured so far."""

    def __init__(self) -> None:
        self._rows: list[np.ndarray] = []
        self._seconds: list[float] = []
        self._coef: np.ndarray | None = None

    @property
    def fitted(self) -> bool:
        return self._coef is not None

    def observe(self, shape: BatchShape, seconds: float) -> None:
        """A measured batch; refits on every batch so far."""
        self._rows.append(_terms(shape))
        self._seconds.append(seconds)
        self._coef, _ = nnls(np.array(self._rows), np.array(self._seconds))

    def seconds(self, shape: BatchShape) -> float:
        if self._coef is None:
            raise RuntimeError("the batch-time estimator has seen no batch")
        return float(_terms(shape) @ self._coef)
