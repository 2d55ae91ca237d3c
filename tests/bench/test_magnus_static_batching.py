"""Magnus' static batching without a model: WMA assembly, HRRN batch choice, split on overflow."""

from __future__ import annotations

import pytest

from bench.magnus.batch_time import BatchShape, MeasuredBatch, batch_time_model
from bench.magnus.static_batching import (
    FcfsStatic,
    MagnusStatic,
    MagnusStaticConfig,
    StaticBatch,
    StaticRequest,
    memory_tokens,
    overflow_step,
    split,
    wma,
)
from services.gpu_worker.engine.policies.linear_cost import OnlineFit


def request(
    rid: str, prompt: int, output: int, predicted: int | None = None, at: float = 0.0
) -> StaticRequest:
    return StaticRequest(rid, at, tuple(range(prompt)), output, output if predicted is None else predicted)


def fitted_estimator() -> OnlineFit[MeasuredBatch]:
    """Seconds ≈ 0.01 per decode step, whatever the batch."""
    estimator = batch_time_model()
    for out in (1, 10, 100):
        estimator.observe((BatchShape(1, 0, out), 0.01 * out))
    return estimator


def magnus(memory_limit: int = 10_000, wma_limit: float = 500.0) -> MagnusStatic:
    return MagnusStatic(
        MagnusStaticConfig(max_batch=4, memory_limit=memory_limit, wma_limit=wma_limit), fitted_estimator()
    )


def test_wma_of_equal_requests_is_one_idle_step_and_grows_with_the_length_gap():
    assert wma([request("a", 10, 5), request("b", 10, 5)]) == pytest.approx(10 + 5)
    # b: 1 step of padding over 10 prompt slots; idle from 5 to 50: 46 steps.
    assert wma([request("a", 10, 50), request("b", 0, 5)]) == pytest.approx(
        5 * 10 + 46 * 10 + (5 + 50) * 46 / 2
    )


def test_requests_of_similar_predicted_length_share_a_batch_and_a_long_one_opens_its_own():
    scheduler = magnus()
    for r in (request("s1", 10, 5), request("long", 10, 100), request("s2", 10, 6)):
        scheduler.add(r)
    batches = [scheduler.next_batch(0.0), scheduler.next_batch(0.0)]
    assert sorted(sorted(x.request_id for x in b.requests) for b in batches) == [["long"], ["s1", "s2"]]


def test_the_memory_guard_keeps_a_batch_under_theta():
    scheduler = magnus(memory_limit=2 * (10 + 5))
    for rid in ("a", "b", "c"):
        scheduler.add(request(rid, 10, 5))
    assert len(scheduler.next_batch(0.0).requests) == 2


def test_the_idle_instance_takes_the_highest_response_ratio():
    scheduler = magnus(wma_limit=0.0)  # every request its own batch
    scheduler.add(request("long-old", 10, 100, at=0.0))  # waited 2 s for a 1 s batch: ratio 3
    scheduler.add(request("short-new", 10, 10, at=1.9))  # waited 0.1 s for a 0.1 s batch: ratio 2
    assert scheduler.next_batch(2.0).requests[0].request_id == "long-old"
    scheduler.add(request("short-newer", 10, 10, at=1.95))
    scheduler.add(request("long-new", 10, 100, at=1.95))
    assert scheduler.next_batch(2.0).requests[0].request_id == "short-new"


def test_an_under_predicted_batch_overflows_where_its_kv_stops_fitting_and_splits_in_halves():
    batch = StaticBatch([request(str(i), 10, 40, predicted=5) for i in range(4)])
    assert memory_tokens(batch.requests, batch.predicted_tokens) == 60
    assert overflow_step(batch, memory_limit=100) == 100 // 4 - 10
    assert overflow_step(batch, memory_limit=200) is None
    first, second = split(batch)
    assert [r.request_id for r in first.requests] == ["0", "1"]
    assert [r.request_id for r in second.requests] == ["2", "3"]
    assert overflow_step(first, memory_limit=100) is None
    with pytest.raises(ValueError, match="cannot be split"):
        split(first.__class__(first.requests[:1]))


def test_split_halves_go_back_ahead_of_the_queue_in_order():
    for scheduler in (FcfsStatic(batch_size=4), magnus()):
        scheduler.add(request("queued", 10, 5))
        halves = split(StaticBatch([request("a", 10, 5), request("b", 10, 5)]))
        scheduler.requeue(halves)
        assert [scheduler.next_batch(0.0).requests[0].request_id for _ in range(3)] == ["a", "b", "queued"]


def test_fcfs_static_takes_the_oldest_fixed_size_batch():
    scheduler = FcfsStatic(batch_size=2)
    for rid in "abc":
        scheduler.add(request(rid, 10, 5))
    assert [r.request_id for r in scheduler.next_batch(0.0).requests] == ["a", "b"]
    assert [r.request_id for r in scheduler.next_batch(0.0).requests] == ["c"]
    assert scheduler.next_batch(0.0) is None
