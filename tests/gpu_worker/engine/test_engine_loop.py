"""The engine thread's loop (``engine/engine_loop.py``): a step that fails fails its batch, and a
request whose release fails as well neither keeps the others running nor ends the thread."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from services.gpu_worker.engine.engine_loop import run_steps
from services.gpu_worker.engine.request import FinishReason


class _Scheduler:
    """Ends requests as the real one does (off ``running``, then its release), one release failing."""

    def __init__(self, engine: SimpleNamespace, failing: str):
        self.engine, self.failing, self.ended = engine, failing, []

    def finish(self, request, reason, token, error=""):
        self.engine.running.remove(request)
        self.ended.append((request.request_id, reason))
        if request.request_id == self.failing:
            raise RuntimeError("its creditor refused the free")


def test_a_failed_step_fails_every_running_request_and_the_thread_goes_on():
    engine = SimpleNamespace(
        stopping=False,
        hand_over=SimpleNamespace(wakeup=threading.Event()),
        recalls=SimpleNamespace(frozen=False),
        waiting=[],
        borrower=None,
        running=[SimpleNamespace(request_id=name) for name in ("a", "b", "c")],
    )
    engine.scheduler = _Scheduler(engine, failing="a")
    steps = []

    def step():
        steps.append(len(engine.running))
        if len(steps) == 1:
            raise RuntimeError("a bug in the step")
        engine.stopping = True  # the thread lived to take another step

    engine.step = step
    engine.has_work = lambda: True
    run_steps(engine)
    assert engine.scheduler.ended == [(r, FinishReason.ERROR) for r in ("a", "b", "c")]
    assert steps == [3, 0]
