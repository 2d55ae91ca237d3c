"""The engine's own thread: steps while there is work, sleeps on the hand-over's wake-up when
there is none, and keeps going when a step fails (the batch fails, not the worker)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from services.gpu_worker.engine.request import FinishReason

if TYPE_CHECKING:
    from services.gpu_worker.engine.engine import Engine

log = logging.getLogger("loramesh.engine")

IDLE_WAIT_S = 0.5
"""How long an idle or blocked engine sleeps before it looks again (a hand-over wakes it now)."""


def run_steps(engine: Engine) -> None:
    """Run ``engine``'s steps until ``engine.stopping``."""
    wakeup = engine.hand_over.wakeup
    while not engine.stopping:
        if not engine.has_work():
            wakeup.wait(IDLE_WAIT_S)
            wakeup.clear()
            continue
        try:
            engine.step()
            if engine.recalls.frozen or not engine.running and engine.waiting and engine.borrower is not None:
                # Frozen by DGFM until its stage closes, or nothing runs and the head of the
                # queue found no lender: look again after a pause (or at the next hand-over),
                # not in a tight loop.
                wakeup.wait(IDLE_WAIT_S)
                wakeup.clear()
        except Exception:  # a bug must not kill the thread silently: fail the batch, go on
            log.exception("engine step failed; failing the running requests")
            fail_running(engine)


def fail_running(engine: Engine) -> None:
    """End every running request with an error; one whose release fails too does not keep the
    others running, nor end the thread."""
    for request in list(engine.running):
        try:
            engine.scheduler.finish(request, FinishReason.ERROR, None, "engine step failed")
        except Exception:
            log.exception("request %s failed, and so did freeing what it held", request.request_id)
