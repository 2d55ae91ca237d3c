"""Traces of real prompts with their real and predicted lengths, for the Magnus runs.

The rows of the length data set (:mod:`bench.magnus.length_dataset`) keep their real generated
length G; each gets G′ from a predictor that never saw it (two folds: each half predicted by the
forest fitted on the other half). Arrivals are Poisson at a given rate.
"""

from __future__ import annotations

import numpy as np

from bench.magnus.length_dataset import LengthRow, chat_ids
from bench.magnus.static_batching import StaticRequest
from services.model_files.tokenizer import Tokenizer
from services.scheduler.length_prediction import (
    LengthPredictor,
    LengthPredictorConfig,
    MiniLmEmbedder,
    PromptInput,
)


def cross_fitted_predictions(rows: list[LengthRow], seed: int) -> list[int]:
    """G′ of every row, each from the forest fitted on the other fold."""
    order = np.random.default_rng(seed).permutation(len(rows))
    folds = (order[: len(rows) // 2], order[len(rows) // 2 :])
    embedder = MiniLmEmbedder()
    predicted = [0] * len(rows)
    for train, test in (folds, folds[::-1]):
        predictor = LengthPredictor(embedder, LengthPredictorConfig(seed=seed))
        predictor.fit(
            [PromptInput(rows[i].prompt, rows[i].prompt_tokens, rows[i].app) for i in train],
            [rows[i].generated_tokens for i in train],
        )
        guesses = predictor.predict(
            [PromptInput(rows[i].prompt, rows[i].prompt_tokens, rows[i].app) for i in test]
        )
        for i, guess in zip(test, guesses):
            predicted[i] = max(1, round(guess.tokens))
    return predicted


def poisson_trace(
    rows: list[LengthRow],
    predicted: list[int],
    tokenizer: Tokenizer,
    requests: int,
    rate_rps: float,
    seed: int,
) -> list[StaticRequest]:
    """``requests`` rows drawn at random (with replacement), arriving as a Poisson process."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(len(rows), size=requests)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_rps, size=requests))
    trace = []
    for n, (i, at) in enumerate(zip(picks, arrivals)):
        row = rows[int(i)]
        ids = chat_ids(tokenizer, row.prompt)
        trace.append(
            StaticRequest(f"r{n}", float(at), tuple(ids), max(1, row.generated_tokens), predicted[int(i)])
        )
    return trace
