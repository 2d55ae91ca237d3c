"""The online step cost model recovers the coefficients of the steps it sees."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from services.gpu_worker.engine.policies.batch_policy import UNMERGED, Merged, StepOutcome
from services.gpu_worker.engine.policies.linear_cost import LinearCost
from services.gpu_worker.engine.policies.step_cost_model import (
    STEP_FIT,
    STEP_TERMS,
    step_cost_model,
    step_row,
)

TRUE = LinearCost.named(
    STEP_TERMS, fixed=0.03, per_prefill_token=0.0004, per_decode_token=0.003, per_adapter=0.002
)


def seconds(cost: LinearCost, prefill: int, decode: int, adapters: int) -> float:
    return cost.predict(step_row(prefill, decode, adapters))


def outcome(prefill: int, decode: int, adapters: int, mode=UNMERGED) -> StepOutcome:
    return StepOutcome(mode, decode + 1, prefill, decode, adapters, seconds(TRUE, prefill, decode, adapters))


def test_the_fit_recovers_a_linear_cost():
    model = step_cost_model(replace(STEP_FIT, window=64, min_rows=16, refit_every=1))
    rng = random.Random(0)
    for _ in range(64):
        model.observe(outcome(rng.randrange(0, 400), rng.randrange(1, 16), rng.randrange(0, 5)))
    assert model.cost.terms == TRUE.terms
    for got, want in zip(model.cost.coefficients, TRUE.coefficients, strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9)


def test_the_prior_answers_until_enough_steps_and_merged_steps_are_not_fitted():
    prior = LinearCost.named(STEP_TERMS, fixed=1.0)
    model = step_cost_model(replace(STEP_FIT, min_rows=16, refit_every=1), prior)
    for i in range(15):
        model.observe(outcome(10 * i, i + 1, i % 3))
    for i in range(40):
        model.observe(outcome(10 * i, i + 1, i % 3, mode=Merged("a")))
    assert model.cost == prior and not model.fitted


def test_a_term_the_steps_do_not_vary_keeps_its_prior():
    prior = LinearCost(STEP_TERMS, (0.5, 0.25, 0.0, 0.125))
    model = step_cost_model(replace(STEP_FIT, min_rows=4, refit_every=1), prior)
    for decode in range(1, 9):  # decode steps only: no prefill, one adapter throughout
        model.observe(outcome(0, decode, 1))
    assert model.cost["per_prefill_token"] == 0.25 and model.cost["per_adapter"] == 0.125
    for decode in (1, 5, 30):  # what it predicts for such steps is still right
        assert seconds(model.cost, 0, decode, 1) == pytest.approx(seconds(TRUE, 0, decode, 1))


def test_an_adapter_count_that_moves_with_the_decodes_is_not_fitted():
    # Every request a different adapter: adapters = decodes in every step, so no fit can tell the
    # per-adapter cost from the per-decode one; the adapter term counts 0 and the decode term
    # takes both.
    prior = LinearCost(STEP_TERMS, (0.5, 0.25, 0.0, 0.125))
    model = step_cost_model(replace(STEP_FIT, min_rows=4, refit_every=1), prior)
    rng = random.Random(1)
    for _ in range(32):
        decode = rng.randrange(1, 9)
        model.observe(outcome(rng.randrange(0, 200), decode, decode))
    assert model.cost["per_adapter"] == 0.0
    assert model.cost["per_decode_token"] == pytest.approx(TRUE["per_decode_token"] + TRUE["per_adapter"])
    for decode in (1, 4, 8):
        assert seconds(model.cost, 100, decode, decode) == pytest.approx(seconds(TRUE, 100, decode, decode))
