"""Magnus' batch time for static batches (SEED-SPECS §3 step 3): the step-cost model
(:class:`LinearCost`) over a static batch's shape, fitted from measured batches.

A static batch of ``bs`` requests prefills them (``bs·L`` tokens, L the longest prompt) and then
decodes ``G`` steps (G the longest output: the batch ends with its longest request), each step
attending over a context that grows from L to L + G:

``T(bs, L, G) = a + b·bs·L + G·(c + d·bs + e·bs·(L + G/2))``

Magnus fits a KNN regressor on (bs, L, G); on a CPU with a few dozen measured batches a KNN
cannot extrapolate to sizes it has not seen, so the same inputs go into this cost form, fitted by
non-negative least squares (every term is a cost) over every batch so far, refitted after each.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gpu_worker.engine.policies.linear_cost import FitConfig, OnlineFit

BATCH_TERMS = ("fixed", "per_prompt_token", "per_step", "per_decode_token", "per_context_token")
"""The batch time's terms (named by their coefficient, seconds: a, b, c, d, e above), in the order
of :meth:`BatchShape.row`."""


@dataclass(frozen=True)
class BatchShape:
    """What the batch-time model sees of a static batch."""

    size: int
    """Requests in the batch (bs)."""
    prompt_tokens: int
    """The longest prompt, L(B)."""
    output_tokens: int
    """The longest output, G(B) (predicted before it runs, measured after)."""

    def row(self) -> tuple[float, ...]:
        """The batch's features, in the order of :data:`BATCH_TERMS`."""
        bs, prompt, out = self.size, self.prompt_tokens, self.output_tokens
        return (1.0, bs * prompt, out, out * bs, out * bs * (prompt + out / 2))


MeasuredBatch = tuple[BatchShape, float]
"""A batch's shape and the seconds it took."""


def _measured(batch: MeasuredBatch) -> tuple[tuple[float, ...], float]:
    shape, seconds = batch
    return shape.row(), seconds


def batch_time_model() -> OnlineFit[MeasuredBatch]:
    """Seconds a static batch takes, fitted (NNLS) on every measured batch so far; no estimate
    (``cost`` raises) before the first."""
    return OnlineFit(BATCH_TERMS, _measured, FitConfig(nonnegative=True))
