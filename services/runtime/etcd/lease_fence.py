"""Whether a member may take new work: not once its etcd lease may be close to expiring.

A member's keys live under a lease it refreshes every TTL/3
(:class:`~services.runtime.etcd.membership.MemberRegistration`). etcd deletes them TTL after the
last refresh *it received*, which is no earlier than the member *sent* it, so the member knows a
lower bound on when everyone else stops seeing it: TTL after the send time of its last
keepalive that etcd answered. The fence goes up :data:`FENCE_FRACTION` of the TTL after that
send time, so a member cut off from etcd stops taking new work at least TTL/3 before its lease
can expire elsewhere (and before lenders reclaim what they lent it, schedulers forget it, and a
replacement may take its place). Work already running goes on.

Any point before the TTL is safe; 2/3 weighs the two ways to be wrong. Earlier fences members
whose refreshes were merely slow: at TTL/2 one refresh that did not get through within TTL/6 of
its due time (a lost packet, an etcd leader election) would fence every worker of the mesh at
once. Later leaves a member that etcd is about to drop taking work for longer. At 2/3 a fenced
member has missed one refresh and a whole further period of retries, and stops taking new
requests a full refresh period (TTL/3: 5 s at the 15 s default) before etcd can delete its keys,
a margin for what the bound does not see (clocks of two hosts running at slightly different
rates, etcd's own expiry checks). The age is read from an injected clock when asked, so a check
is never late and a test never races real time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

FENCE_FRACTION = 2 / 3
"""The fence goes up once this fraction of the TTL has passed since the last keepalive sent that
etcd answered."""


class LeaseFence:
    """What a member's lease keepalives say about taking new work; ``problem()`` is "" while it
    may. ``clock`` is monotonic seconds (injected in tests)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._ttl_s = ttl_s
        self._renewed_at: float | None = None
        self._lost = False
        self._last_error = ""

    @property
    def fence_after_s(self) -> float:
        """Seconds after the last answered keepalive was sent at which the fence goes up."""
        return self._ttl_s * FENCE_FRACTION

    def renewed(self, sent_at: float, ttl_s: float) -> None:
        """A keepalive (refresh or new registration) sent at ``sent_at`` (``clock`` time) was
        answered: the lease, granted with ``ttl_s``, lives at least until ``sent_at + ttl_s``."""
        self._renewed_at, self._ttl_s = sent_at, ttl_s
        self._lost, self._last_error = False, ""

    def failed(self, error: str) -> None:
        """A keepalive failed with ``error`` (kept for the fence's message)."""
        self._last_error = error

    def lost(self, error: str) -> None:
        """etcd answered that the lease is gone: the keys went with it, fence at once."""
        self._lost, self._last_error = True, error

    def problem(self) -> str:
        """ "" while the member may take new work; else why not, in one line naming etcd."""
        if self._renewed_at is None:
            return "it is not registered in etcd yet"
        if self._lost:
            return f"it lost its etcd lease ({self._last_error}) and is registering again"
        age = self.clock() - self._renewed_at
        if age < self.fence_after_s:
            return ""
        cause = f"; last error: {self._last_error}" if self._last_error else ""
        return (
            f"it lost etcd: no lease keepalive answered for {age:.1f} s (fenced after "
            f"{self.fence_after_s:.1f} s of its {self._ttl_s:g} s lease TTL{cause})"
        )
