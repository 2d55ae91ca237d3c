"""DistKV-LLM's compute cap on a creditor, alone, on an injected clock: a share of wall time over
a sliding window, checked before each remote attention call, enforced only while the creditor
has requests of its own; the refusal names the cap and says when to retry."""

from __future__ import annotations

import pytest

from services.gpu_worker.distkv.lend_compute_cap import LendComputeCap, LendComputeExhausted
from services.runtime.errors import ResourceExhausted


class Clock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def serve(cap: LendComputeCap, clock: Clock, seconds: float) -> None:
    """One admitted call that computes for ``seconds``."""
    started = cap.admit()
    clock.now += seconds
    cap.done(started)


def test_calls_are_admitted_until_the_windows_budget_is_spent():
    clock = Clock()
    cap = LendComputeCap(share=0.25, window_s=4.0, clock=clock)  # 1 s per 4 s window
    serve(cap, clock, 0.6)
    serve(cap, clock, 0.6)  # 0.6 used < 1: admitted, and it overshoots to 1.2
    assert cap.used_s() == pytest.approx(1.2)
    with pytest.raises(LendComputeExhausted) as refused:
        cap.admit()
    assert isinstance(refused.value, ResourceExhausted)  # RESOURCE_EXHAUSTED on the wire
    message = refused.value.message
    assert "--lend-compute-share 0.25" in message and "1.200 s of the last 4 s" in message
    # 0.2 s of the first call must slide out: at t = 4.2 the window is [0.2, 4.2].
    assert refused.value.retry_after_s == pytest.approx(4.2 - 1.2)
    assert cap.refused == 1


def test_the_window_slides_old_work_out():
    clock = Clock()
    cap = LendComputeCap(share=0.25, window_s=4.0, clock=clock)  # 1 s per 4 s window
    serve(cap, clock, 1.0)  # [0, 1]
    clock.now = 3.5
    with pytest.raises(LendComputeExhausted):
        cap.admit()
    clock.now = 4.5  # the call [0, 1] is half out of the window [0.5, 4.5]
    assert cap.used_s() == pytest.approx(0.5)
    serve(cap, clock, 0.5)  # admitted: 0.5 < 1; [4.5, 5]
    assert cap.used_s() == pytest.approx(0.5)  # at 5: [0, 1] is out, [4.5, 5] in
    serve(cap, clock, 0.5)  # [5, 5.5]
    with pytest.raises(LendComputeExhausted):
        cap.admit()
    assert cap.refused == 2


def test_a_retry_after_the_hint_is_admitted():
    clock = Clock()
    cap = LendComputeCap(share=0.5, window_s=2.0, clock=clock)
    serve(cap, clock, 0.4)
    clock.now += 0.1
    serve(cap, clock, 0.9)  # 1.3 s used of a 1 s budget, by t = 1.4
    with pytest.raises(LendComputeExhausted) as refused:
        cap.admit()
    clock.now += refused.value.retry_after_s + 1e-9
    cap.admit()


def test_an_idle_creditor_is_not_capped_but_its_lending_is_counted():
    clock = Clock()
    own_requests: list[str] = []
    cap = LendComputeCap(share=0.1, window_s=1.0, clock=clock, busy=lambda: bool(own_requests))
    serve(cap, clock, 0.5)
    serve(cap, clock, 0.4)  # far over 0.1 s, but nobody of its own waits for it
    assert cap.refused == 0
    own_requests.append("mine")  # a request of its own arrives: the window is as it was
    with pytest.raises(LendComputeExhausted):
        cap.admit()


def test_share_one_is_no_cap_and_share_zero_refuses_every_call_while_busy():
    clock = Clock()
    free = LendComputeCap(share=1.0, window_s=1.0, clock=clock)
    for _ in range(5):
        serve(free, clock, 1.0)
    assert free.refused == 0
    none = LendComputeCap(share=0.0, window_s=1.0, clock=clock)
    with pytest.raises(LendComputeExhausted, match="--lend-compute-share is 0"):
        none.admit()


def test_a_failed_call_still_counts_its_time():
    clock = Clock()
    cap = LendComputeCap(share=0.5, window_s=1.0, clock=clock)
    with pytest.raises(RuntimeError), cap.serving():
        clock.now += 0.7
        raise RuntimeError("the attention failed")
    assert cap.used_s() == pytest.approx(0.7)
    with pytest.raises(LendComputeExhausted):
        cap.admit()


@pytest.mark.parametrize("share, window_s", [(-0.1, 1.0), (1.5, 1.0), (0.5, 0.0)])
def test_bad_settings_are_refused(share, window_s):
    with pytest.raises(ValueError, match="lend compute"):
        LendComputeCap(share=share, window_s=window_s)
