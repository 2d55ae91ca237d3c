"""A pinned step-cost model for engine tests that speculate: their drafting decisions must not
depend on the machine's speed (the engine's own model is fitted from measured steps)."""

from __future__ import annotations

import dataclasses

from services.gpu_worker.engine.engine import Engine
from services.gpu_worker.engine.policies.linear_cost import LinearCost
from services.gpu_worker.engine.policies.step_cost_model import STEP_TERMS
from services.gpu_worker.engine.speculation.draft_cost import fixed_cost

CHEAP_ROWS = LinearCost.named(STEP_TERMS, fixed=0.02, per_decode_token=0.0002)
"""A memory-bound step (a row costs 1% of a batch-1 step): a draft with a fair chance pays
even in a wide batch, so the exactness tests verify drafts in every step they can."""


def pin_draft_cost(engine: Engine, cost: LinearCost = CHEAP_ROWS) -> Engine:
    """``engine`` (speculating or not) with its drafts priced by ``cost``, not a fit (no floor
    under its row cost, no verifying step's extra cost)."""
    if engine.speculator is not None:
        engine.speculator.cost = fixed_cost(cost)
        engine.speculator.settings = dataclasses.replace(
            engine.speculator.settings, min_row_share=0.0, verify_step_share=0.0
        )
    return engine
