"""Whether a draft is worth its rows, by the step-cost model.

A step of ``B`` decode rows costs ``C(B) = fixed + per_decode_token·B (+ adapters)``: each of its
tokens costs ``C(B)/B`` of the batch's time. A draft token adds a row (``per_decode_token``) to
this step and, when accepted, is a token no later step has to compute: it saves ``C(B)/B``. With
a chance ``p`` that one more draft position is accepted (``acceptance.py``), the ``j``-th draft
token is accepted with chance ``pʲ`` (all before it were), so it pays when
``pʲ · C(B)/B > per_decode_token``. A step that verifies any draft also costs a little more than
its rows say (its inputs go through the step builder, not the persistent decode batch), so a
step drafts only when its drafts' expected savings together exceed that (``step_s``). At batch 1 with Q4_1 the step reads every weight for one row
and a row is nearly free, so long drafts pay; at batch 8 on 2 cores a row is a real share of the
step, and only requests that keep being accepted draft, fewer tokens. The model is the engine's
step cost, fitted online from its own steps (``policies/step_cost_model.py``): it counts draft
rows as decode tokens, so it learns what they cost on this machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gpu_worker.engine.policies.batch_policy import StepOutcome
from services.gpu_worker.engine.policies.linear_cost import LinearCost, OnlineFit
from services.gpu_worker.engine.policies.step_cost_model import STEP_TERMS, step_row


@dataclass(frozen=True)
class DraftPrices:
    """What a step's tokens and draft rows cost, in seconds."""

    token_s: float
    """What one token of a plain decode step of this batch costs (``C(B)/B``): an accepted draft
    token's saving."""
    row_s: float
    """What one more row costs the step (``per_decode_token``)."""
    step_s: float = 0.0
    """What verifying any draft costs the step beyond its rows."""

    def worth(self, acceptance: float, ceiling: int) -> int:
        """Draft tokens worth drafting (``ceiling`` at most) at this per-position ``acceptance``:
        the largest ``k`` whose ``k``-th token still saves more than its row costs
        (``acceptanceᵏ · token_s > row_s``); each further token saves less, so none beyond pays."""
        k, chance = 0, acceptance
        while k < ceiling and chance * self.token_s > self.row_s:
            k, chance = k + 1, chance * acceptance
        return k

    def saving(self, acceptance: float, k: int) -> float:
        """What ``k`` draft tokens save on average beyond their rows (``step_s`` aside)."""
        return sum(acceptance**j * self.token_s - self.row_s for j in range(1, k + 1))


def draft_prices(
    cost: LinearCost,
    decode_rows: int,
    adapters: int,
    min_row_share: float = 0.0,
    verify_step_share: float = 0.0,
) -> DraftPrices:
    """The prices of a step with ``decode_rows`` decoding requests of ``adapters`` distinct
    adapters: a plain decode step's cost per token (any prefill in the step aside: an accepted
    token saves a decode row later, not a prefill) and the cost of a row, taken as at least
    ``min_row_share`` of a batch-1 step (``DraftSettings.min_row_share``: a fit on noisy steps
    can call a row free, its slope clamped at 0, and a row does work), and a verifying step's
    extra ``verify_step_share`` of a batch-1 step (``DraftSettings.verify_step_share``)."""
    rows = max(1, decode_rows)
    single = cost.predict(step_row(0, 1, 0))
    row_s = max(cost["per_decode_token"], min_row_share * single)
    return DraftPrices(cost.predict(step_row(0, rows, adapters)) / rows, row_s, verify_step_share * single)


def fixed_cost(cost: LinearCost) -> OnlineFit[StepOutcome]:
    """A step-cost model that stays ``cost`` whatever steps it is shown: drafting decisions that
    do not depend on the machine's speed (tests; benchmarks that pin them)."""
    return OnlineFit(STEP_TERMS, lambda outcome: None, prior=cost)
