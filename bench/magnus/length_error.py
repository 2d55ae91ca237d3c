"""Magnus' length predictor on a held-out set (issue 16, SEED-SPECS §3 "Reproducible here" 1).

Builds (or reuses) the data set of :mod:`bench.magnus.length_dataset`, splits it at random into
training and held-out rows, fits the predictor on the training rows and reports the mean absolute
error (tokens) and Pearson correlation on the held-out rows, against two baselines: the training
mean (a predictor that knows nothing), and the same forest without the embedding (prompt length
and app only). Continuous learning: a predictor fitted on a quarter of the training rows, then
fed the other three quarters as completed requests (mispredicted ones join its set and refit
it), is scored on the same held-out rows before and after.

    .venv/bin/python -m bench.magnus.length_error [--per-app 40] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from bench.magnus import length_dataset
from bench.magnus.length_dataset import LengthRow
from bench.out_dir import default_out
from services.scheduler.length_prediction import (
    Embedder,
    LengthPredictor,
    LengthPredictorConfig,
    MiniLmEmbedder,
    PromptInput,
)

RESULTS = default_out("magnus")


class NoEmbedding:
    """An embedding that says nothing: the forest sees prompt length and app only."""

    def encode(self, texts: list[str]) -> np.ndarray:
        return np.zeros((len(texts), 1))


def _inputs(rows: list[LengthRow]) -> list[PromptInput]:
    return [PromptInput(r.prompt, r.prompt_tokens, r.app) for r in rows]


def _scores(predicted: np.ndarray, actual: np.ndarray) -> dict:
    pearson = float(np.corrcoef(predicted, actual)[0, 1]) if np.ptp(predicted) > 0 else 0.0
    return {"mae_tokens": round(float(np.abs(predicted - actual).mean()), 2), "pearson": round(pearson, 3)}


def _forest(embedder: Embedder, train: list[LengthRow], config: LengthPredictorConfig) -> LengthPredictor:
    predictor = LengthPredictor(embedder, config)
    predictor.fit(_inputs(train), [r.generated_tokens for r in train])
    return predictor


def _predicted(predictor: LengthPredictor, rows: list[LengthRow]) -> np.ndarray:
    return np.array([p.tokens for p in predictor.predict(_inputs(rows))])


def continuous_learning(
    embedder: Embedder, train: list[LengthRow], held_out: list[LengthRow], config: LengthPredictorConfig
) -> dict:
    """Fit on the first quarter, stream the rest as completions, score before and after."""
    seed_rows, stream = train[: len(train) // 4], train[len(train) // 4 :]
    actual = np.array([r.generated_tokens for r in held_out])
    predictor = _forest(embedder, seed_rows, config)
    before = _scores(_predicted(predictor, held_out), actual)
    for row, prediction in zip(stream, predictor.predict(_inputs(stream))):
        predictor.observe(prediction, row.generated_tokens)
    predictor.wait_for_refit()
    return {
        "seed_rows": len(seed_rows),
        "streamed": len(stream),
        "before": before,
        "after": _scores(_predicted(predictor, held_out), actual),
        **{k: predictor.stats()[k] for k in ("mispredicted", "retrains", "training_rows")},
    }


def evaluate(rows: list[LengthRow], held_out_share: float, seed: int) -> dict:
    order = np.random.default_rng(seed).permutation(len(rows))
    cut = int(len(rows) * (1 - held_out_share))
    train = [rows[i] for i in order[:cut]]
    held_out = [rows[i] for i in order[cut:]]
    actual = np.array([r.generated_tokens for r in held_out])
    config = LengthPredictorConfig(seed=seed, retrain_after=8)
    embedder = MiniLmEmbedder()
    mean = float(np.mean([r.generated_tokens for r in train]))
    apps = sorted({r.app for r in rows})
    started = time.monotonic()
    full = _forest(embedder, train, config)
    fit_s = time.monotonic() - started
    predicted = _predicted(full, held_out)
    return {
        "rows": len(rows),
        "train": len(train),
        "held_out": len(held_out),
        "mean_generated_tokens": round(float(actual.mean()), 1),
        "baseline_mean": _scores(np.full(len(held_out), mean), actual),
        "forest_without_embedding": _scores(
            _predicted(_forest(NoEmbedding(), train, config), held_out), actual
        ),
        "magnus_predictor": {**_scores(predicted, actual), "fit_s": round(fit_s, 2)},
        "per_app_mae_tokens": {
            app: round(
                float(
                    np.mean(
                        [abs(p - r.generated_tokens) for p, r in zip(predicted, held_out) if r.app == app]
                    )
                ),
                1,
            )
            for app in apps
            if any(r.app == app for r in held_out)
        },
        "continuous_learning": continuous_learning(embedder, train, held_out, config),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-app", type=int, default=40, help="prompts per app")
    parser.add_argument("--max-tokens", type=int, default=160, help="output cap of the generation")
    parser.add_argument("--max-running", type=int, default=32, help="engine batch while generating")
    parser.add_argument("--held-out", type=float, default=0.3, help="share of rows held out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", type=Path, default=RESULTS / "length_dataset.json",
                        help="reused when it exists; built (generating with the model) otherwise")  # fmt: skip
    args = parser.parse_args()
    if args.dataset.exists():
        rows = length_dataset.load(args.dataset)
    else:
        started = time.monotonic()
        rows = length_dataset.build(args.per_app, args.max_tokens, args.max_running, args.seed, print)
        print(f"generated {len(rows)} answers in {time.monotonic() - started:.0f} s")
        length_dataset.save(rows, args.dataset)
    result = {"load_average": os.getloadavg(), **evaluate(rows, args.held_out, args.seed)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "length_error.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
