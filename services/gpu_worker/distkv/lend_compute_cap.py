"""DistKV-LLM's compute cap on a creditor (seed 003 L90): each rManager has an SLA-derived
threshold on how much of its compute remote micro-attentions may use. Beyond it, the creditor
refuses ``AttendRemote`` (:class:`LendComputeExhausted`, ``RESOURCE_EXHAUSTED``) and the debtor
falls back: it gives those blocks back and recomputes the requests that had some, borrowing from
another creditor or waiting for room of its own (``RequestScheduler.creditor_refused``).

**What is capped: a share of wall time over a sliding window**, not a budget per engine step.
The SLA being protected is the creditor's own requests' latency (time per output token): remote
attention runs on the same device while its engine steps, so a creditor that spends a share
``s`` of its time on it stretches its own steps by up to ``1 / (1 - s)``. An SLA that tolerates
its steps taking ``k``× their unloaded time gives ``s = 1 - 1/k`` (0.5: ≤ 2×). Per engine step
would tie the cap to the creditor's step loop, which an idle creditor does not run; a window of
wall time (about a few decode steps, 1 s by default) is what a latency SLA is measured over.

**Only while the creditor has work of its own** (``busy``): with no request of its own running
or queued, there is no SLA to protect, and refusing would only make the debtor recompute. Its
lent time is still recorded then, so a request that arrives finds the window as it is.

A call is admitted while the lent time inside the window is under the budget (``share`` ×
``window_s``); its own length is known only afterwards, so one admitted call may overshoot the
budget, and the next are refused until enough of it has slid out. Pure domain: no gRPC, an
injected clock, its own lock (RPC threads call it).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from services.runtime.errors import ResourceExhausted

Clock = Callable[[], float]

DEFAULT_LEND_COMPUTE_SHARE = 0.5
"""A busy creditor's own steps take at most about 2× their unloaded time because of lending."""
DEFAULT_LEND_COMPUTE_WINDOW_S = 1.0


class LendComputeExhausted(ResourceExhausted):
    """The creditor's lent-compute budget is spent: it refuses this remote attention."""


class LendComputeCap:
    """The share of wall time a creditor may spend computing attention for debtors."""

    def __init__(
        self,
        share: float = DEFAULT_LEND_COMPUTE_SHARE,
        window_s: float = DEFAULT_LEND_COMPUTE_WINDOW_S,
        clock: Clock = time.monotonic,
        busy: Callable[[], bool] | None = None,
    ):
        """``share``: in [0, 1]; 1 is no cap, 0 refuses every remote attention while busy.
        ``window_s``: the sliding window, seconds. ``clock``: seconds, monotonic. ``busy``: whether
        the creditor has requests of its own now (None: always, the cap always applies)."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"lend compute share must be in [0, 1], got {share}")
        if window_s <= 0:
            raise ValueError(f"lend compute window must be > 0 s, got {window_s}")
        self.share = share
        self.window_s = window_s
        self.clock = clock
        self.busy = busy
        self.refused = 0
        """Remote attention calls refused so far."""
        self._served: deque[tuple[float, float]] = deque()  # (start, end), in order
        self._lock = threading.Lock()

    @property
    def budget_s(self) -> float:
        """Lent seconds allowed inside one window."""
        return self.share * self.window_s

    def used_s(self, now: float | None = None) -> float:
        """Seconds spent on remote attention inside the window ending ``now`` (default: the clock)."""
        with self._lock:
            return self._used(self.clock() if now is None else now)

    def admit(self) -> float:
        """Start serving one remote attention call; its start time, for :meth:`done`.
        ``LendComputeExhausted`` when the creditor is busy and the window's budget is spent."""
        with self._lock:
            now = self.clock()
            if self.share >= 1.0 or (self.busy is not None and not self.busy()):
                return now
            used = self._used(now)
            if used < self.budget_s:
                return now
            self.refused += 1
            if self.share == 0.0:
                raise LendComputeExhausted(
                    "remote attention refused: --lend-compute-share is 0, this creditor computes no "
                    "attention for debtors while it has requests of its own; use another creditor"
                )
            retry_after = self._retry_after(now, used)
        raise LendComputeExhausted(
            f"remote attention refused: this creditor spent {used:.3f} s of the last {self.window_s:g} s "
            f"computing attention for debtors, at its cap (--lend-compute-share {self.share:g} = "
            f"{self.budget_s:.3f} s per window) while it has requests of its own; retry in "
            f"{retry_after:.3f} s or use another creditor",
            retry_after_s=retry_after,
        )

    def done(self, started: float) -> float:
        """The call admitted at ``started`` has ended: record it; its seconds."""
        with self._lock:
            now = self.clock()
            self._served.append((started, now))
            self._prune(now)  # not the sum: calls come per layer, hundreds a second
            return now - started

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Admit one call (or raise), and record its time when it ends, even with an error."""
        started = self.admit()
        try:
            yield
        finally:
            self.done(started)

    def _used(self, now: float) -> float:
        since = self._prune(now)
        return sum(end - max(start, since) for start, end in self._served)

    def _prune(self, now: float) -> float:
        """Forget the calls that ended before the window ending ``now``; its start."""
        since = now - self.window_s
        served = self._served
        while served and served[0][1] <= since:
            served.popleft()
        return since

    def _retry_after(self, now: float, used: float) -> float:
        """Seconds until the lent time inside the window drops under the budget (nothing more lent)."""
        excess = used - self.budget_s
        since = now - self.window_s
        for start, end in self._served:  # the oldest slide out first
            start = max(start, since)
            if end - start > excess:
                return start + excess - since
            excess -= end - start
        return 0.0
