"""The waiting queue: order, O(1) removal by id, and a policy view made once per request and
rebuilt only when the queue changes (a saturated worker's planning must not grow with its queue)."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import EngineRequest, GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.engine.waiting_queue import WaitingQueue
from services.gpu_worker.model.llama import LlamaModel


def _request(request_id: str) -> EngineRequest:
    spec = GenerationRequest(request_id, (1, 2, 3), SamplingParams(max_tokens=4), None)
    return EngineRequest(spec=spec, kv=None)  # the queue never reads the KV table


class _Counting:
    def __init__(self):
        self.calls = 0

    def __call__(self, request):
        self.calls += 1
        return request.request_id


def test_order_front_insertion_and_removal():
    describe = _Counting()
    queue = WaitingQueue(describe)
    a, b, c = _request("a"), _request("b"), _request("c")
    queue.append(a)
    queue.append(b)
    queue.appendleft(c)
    assert [r.request_id for r in queue] == ["c", "a", "b"] and queue.ids() == ("c", "a", "b")
    assert queue.view() == ("c", "a", "b")
    queue.remove(a)
    assert queue.ids() == ("c", "b") and a not in queue and c in queue and len(queue) == 2
    assert queue.get("b") is b and queue.get("a") is None
    with pytest.raises(ValueError, match="not waiting"):
        queue.remove(a)
    with pytest.raises(ValueError, match="already waiting"):
        queue.append(b)
    assert describe.calls == 3  # once per join, never per read


def test_view_is_rebuilt_only_after_a_change():
    queue = WaitingQueue(lambda r: r.request_id)
    queue.append(_request("a"))
    first = queue.view()
    assert queue.view() is first and queue.ids() is queue.ids()
    queue.append(_request("b"))
    assert queue.view() is not first and queue.view() == ("a", "b")


def test_a_long_queue_is_described_once_per_request_over_many_steps(tiny_llama, monkeypatch):
    """1,000 queued requests, 2 running: stepping reads the queue every step, but each request's
    policy view is made once (when it joined), not once per step."""
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine = local_engine(model, EngineConfig(pool_mib=4, max_running=2))
    made = _Counting()
    describe = engine.scheduler.waiting._describe
    monkeypatch.setattr(engine.scheduler.waiting, "_describe", lambda r: (made(r), describe(r))[1])
    sampling = SamplingParams(max_tokens=50, ignore_eos=True)
    for i in range(1000):
        engine.submit(GenerationRequest(f"r{i}", (5, 6, 7), sampling, None), lambda event: None)
    for _ in range(20):
        engine.step()
    assert engine.stats().running == 2 and engine.stats().queue == 998
    assert made.calls == 1000
