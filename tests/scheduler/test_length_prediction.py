"""Magnus' length predictor: fit, predict, and the continuous-learning trigger (a tiny embedding
stands in for MiniLM, except in the last test, which runs the real model once)."""

from __future__ import annotations

import numpy as np
import pytest

from services.scheduler.length_prediction import (
    LengthPrediction,
    LengthPredictor,
    LengthPredictorConfig,
    MiniLmEmbedder,
    PromptInput,
    compress_embedding,
)


class KeywordEmbedder:
    """A 4-dim embedding: which of a few words the prompt holds (enough to tell tasks apart)."""

    WORDS = ("list", "word", "essay", "translate")

    def encode(self, texts: list[str]) -> np.ndarray:
        return np.array([[float(w in t) for w in self.WORDS] for t in texts])


def prompts_and_lengths() -> tuple[list[PromptInput], list[int]]:
    prompts, lengths = [], []
    for n in range(1, 21):
        prompts.append(PromptInput(f"list {n} fruits", 4, "a"))
        lengths.append(3 * n)
        prompts.append(PromptInput("answer in one word", 4, "a"))
        lengths.append(2)
        prompts.append(PromptInput(f"write an essay number {n}", 5, "b"))
        lengths.append(200)
    return prompts, lengths


def predictor(**knobs) -> LengthPredictor:
    return LengthPredictor(KeywordEmbedder(), LengthPredictorConfig(embedding_groups=4, trees=20, **knobs))


def test_group_compression_sums_each_group_over_its_root_size():
    compressed = compress_embedding(np.array([1.0, 1.0, 1.0, 1.0, 2.0, 2.0]), groups=2)
    assert compressed == pytest.approx([3 / np.sqrt(3), 5 / np.sqrt(3)])


def test_a_fitted_forest_tells_the_tasks_apart():
    model = predictor()
    model.fit(*prompts_and_lengths())
    word, essay = model.predict(
        [PromptInput("answer in one word", 4, "a"), PromptInput("write an essay number 3", 5, "b")]
    )
    assert word.tokens < 10 and essay.tokens > 150
    assert len(word.features) == 4 + 2


def test_predicting_before_fitting_is_an_error():
    with pytest.raises(RuntimeError, match="never fitted"):
        predictor().predict([PromptInput("x", 1, None)])


def test_only_errors_over_10_tokens_and_10_percent_are_learned_from():
    model = predictor()
    guess = LengthPrediction(100.0, (0.0,) * 6)
    assert not model.observe(guess, 108)  # 8 tokens off
    assert model.observe(guess, 1000)  # 900 tokens and 90% off: learned
    assert not model.observe(LengthPrediction(1000.0, guess.features), 1050)  # 50 tokens but 5%
    assert model.observe(LengthPrediction(10.0, guess.features), 30)  # 20 tokens and 67%
    assert model.stats()["mispredicted"] == 2 and model.stats()["observed"] == 4


def test_enough_mispredictions_refit_in_the_background_and_fix_the_prediction():
    model = predictor(retrain_after=8)
    prompts, lengths = prompts_and_lengths()
    model.fit(prompts, lengths)
    translate = PromptInput("translate this sentence", 4, "c")
    before = model.predict([translate])[0]
    assert abs(before.tokens - 60) > 10
    for _ in range(8):
        assert model.observe(model.predict([translate])[0], 60)
    model.wait_for_refit()
    assert model.stats()["retrains"] == 1
    assert model.predict([translate])[0].tokens == pytest.approx(60, abs=10)


def test_the_real_minilm_embedding_separates_short_and_long_tasks():
    embedder = MiniLmEmbedder()
    model = LengthPredictor(embedder, LengthPredictorConfig(trees=20))
    model.fit(*prompts_and_lengths())
    assert embedder.encode(["hello"]).shape == (1, 384)
    word, essay = model.predict(
        [PromptInput("answer in one word", 4, "a"), PromptInput("write an essay number 7", 5, "b")]
    )
    assert word.tokens < 50 and essay.tokens > 150


def test_mispredictions_that_come_during_a_refit_are_learned_by_the_next_one():
    model = predictor(retrain_after=4)
    model.fit(*prompts_and_lengths())
    guess = LengthPrediction(1.0, model.predict([PromptInput("translate this", 3, "c")])[0].features)
    for _ in range(8):
        assert model.observe(guess, 60)
    model.wait_for_refit()
    assert model.stats()["retrains"] == 2 and model.stats()["training_rows"] == 60 + 8
