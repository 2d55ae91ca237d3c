"""Magnus' batch-time model fitted from measured batches (here: times drawn from known costs)."""

from __future__ import annotations

import pytest

from bench.magnus.batch_time import BatchShape, batch_time_model


def true_seconds(shape: BatchShape) -> float:
    bs, prompt, out = shape.size, shape.prompt_tokens, shape.output_tokens
    return 0.05 + 0.0004 * bs * prompt + out * (0.02 + 0.003 * bs + 1e-6 * bs * (prompt + out / 2))


def test_it_recovers_the_cost_of_batches_it_never_saw():
    estimator = batch_time_model()
    for size in (1, 4, 16):
        for prompt in (20, 100):
            for out in (8, 64):
                shape = BatchShape(size, prompt, out)
                estimator.observe((shape, true_seconds(shape)))
    for unseen in (BatchShape(8, 60, 32), BatchShape(32, 150, 128), BatchShape(2, 10, 4)):
        assert estimator.cost.predict(unseen.row()) == pytest.approx(true_seconds(unseen), rel=0.01)


def test_no_estimate_before_a_batch_was_seen():
    estimator = batch_time_model()
    assert not estimator.fitted
    with pytest.raises(RuntimeError, match="seen no observation"):
        estimator.cost.predict(BatchShape(1, 1, 1).row())
