"""Run requests on an in-process engine to the end, discarding their events, and time it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from services.gpu_worker.engine.engine import Engine
from services.gpu_worker.engine.request import GenerationRequest


def serve_to_the_end(
    engine: Engine, requests: Iterable[GenerationRequest], clock: Callable[[], float] = time.perf_counter
) -> float:
    """Submit ``requests`` and step ``engine`` here until it has no work: ``clock``'s seconds for
    the stepping (``time.thread_time`` for this thread's CPU)."""
    for request in requests:
        engine.submit(request, lambda event: None)
    started = clock()
    while engine.has_work():
        engine.step()
    return clock() - started
