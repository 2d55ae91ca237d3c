"""A step's cost, fitted online from measured steps (PetS's α/β latency model, SEED-SPECS §4).

``seconds ≈ fixed + per_prefill_token·prefill + per_decode_token·decode + per_adapter·adapters``

The engine's :class:`~services.gpu_worker.engine.policies.linear_cost.LinearCost` over
:data:`STEP_TERMS`: ``fixed`` and the token terms are the shared (α) part; ``per_adapter`` is the
adapter (β) part that grows with the number of distinct adapters in the step. Fitted by least
squares with priors over the last ``window`` unmerged steps, refitted every ``refit_every``
observations; until enough steps were seen the prior (measured once on this CPU) answers.
"""

from __future__ import annotations

from services.gpu_worker.engine.policies.batch_policy import StepOutcome, Unmerged
from services.gpu_worker.engine.policies.linear_cost import FitConfig, LinearCost, OnlineFit

STEP_TERMS = ("fixed", "per_prefill_token", "per_decode_token", "per_adapter")
"""The step cost's terms (named by their coefficient, in seconds), in the order of :func:`step_row`."""


def step_row(prefill_tokens: int, decode_tokens: int, adapters: int) -> tuple[float, ...]:
    """A step's features in the order of :data:`STEP_TERMS`."""
    return (1.0, prefill_tokens, decode_tokens, adapters)


DEFAULT_PRIOR = LinearCost(STEP_TERMS, (0.02, 0.0005, 0.002, 0.001))
"""SmolLM2-135M fp32 on 2 AVX2 cores, rounded; only used until the model has seen steps."""

STEP_FIT = FitConfig(window=256, min_rows=16, refit_every=16, confounded=("per_adapter",))
"""How the engine's step cost learns: the last 256 unmerged steps, refitted every 16 once 16 were
seen. The adapter count is confounded when it moves with the token counts (every request a
different adapter: adapters = decodes in every step): then it counts 0 and the token terms take
its cost, which predicts such steps right and claims no adapter cost unseen."""


def unmerged_step(outcome: StepOutcome) -> tuple[tuple[float, ...], float] | None:
    """An unmerged step's features and seconds; None for a merged one (the model does not cover it)."""
    if not isinstance(outcome.mode, Unmerged):
        return None
    return step_row(outcome.prefill_tokens, outcome.decode_tokens, outcome.adapters), outcome.seconds


def step_cost_model(
    config: FitConfig = STEP_FIT, prior: LinearCost = DEFAULT_PRIOR
) -> OnlineFit[StepOutcome]:
    """The step cost of unmerged steps, fitted online (what the batch policies' ``observe`` feeds)."""
    return OnlineFit(STEP_TERMS, unmerged_step, config, prior)
