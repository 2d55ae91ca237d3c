"""Room for a waiting request's adapter when every resident adapter is held (the slot cliff).

While a request's adapter finds no room in the pool, it keeps its place and admission goes on
behind it only for requests that need no page-in; meanwhile one held adapter drains: the one
whose running requests end soonest takes no new requests, so that its pages free for the waiting
one. Should its adapter still find no room once that one drained (a unified pool's pages went to
the KV of requests started meanwhile), or should no held adapter be able to drain, the waiting
request stops admission like one whose KV does not fit, until it starts.
"""

from __future__ import annotations

from collections.abc import Callable

from services.gpu_worker.engine.adapter_pager import AdapterPager
from services.gpu_worker.engine.request import EngineRequest


class AdapterRoom:
    """The draining state across admission rounds (engine thread only)."""

    def __init__(self, adapters: AdapterPager, tokens_left: Callable[[EngineRequest], int]):
        self.adapters = adapters
        self.tokens_left = tokens_left
        self.waiter: EngineRequest | None = None
        """This admission round's first request whose adapter found no room in the pool."""
        self._refused = False
        """A request found no room for its adapter this admission round."""
        self.draining: str | None = None
        """The held adapter taking no new requests while a request waits for adapter room."""
        self._drain_for: str | None = None
        """The request the draining adapter drains for."""
        self._drained = False
        """The draining adapter drained and that request still finds no room for its adapter:
        admission stops at it until its adapter is paged in."""

    def begin_round(self, running: list[EngineRequest]) -> None:
        self.waiter, self._refused = None, False
        if self.draining is not None and not any(
            r.holds_adapter and r.spec.adapter_id == self.draining for r in running
        ):
            self.draining, self._drained = None, True  # its pages are idle, for the waiting one

    def end_round(self) -> None:
        if not self._refused:  # nobody waits for adapter room (any more)
            self.draining, self._drain_for, self._drained = None, None, False

    def holds_back(self, request: EngineRequest) -> bool:
        """Whether ``request`` waits behind this round's request that found no adapter room: it
        would page in another adapter ahead of it, or its adapter is draining."""
        adapter_id = request.spec.adapter_id
        if self.waiter is None or adapter_id is None:
            return False
        return adapter_id == self.draining or adapter_id not in self.adapters.residency

    def refused(self, request: EngineRequest, running: list[EngineRequest]) -> bool:
        """``request``'s adapter found no room: whether an adapter drains for it (it keeps its
        place, admission goes on behind it) or not (it stops admission)."""
        self._refused = True
        if self._drain_for != request.request_id:  # another request waits now
            self._drain_for, self._drained = request.request_id, False
        if self.draining is None and not self._drained:
            self.draining = self._choose_draining(running)
        if self.draining is None:
            return False
        self.waiter = request
        return True

    def _choose_draining(self, running: list[EngineRequest]) -> str | None:
        """The held adapter whose running requests end soonest (fewest tokens left to its
        longest one), the merged one and pinned ones aside (a pinned adapter is never evicted, so
        draining it would hold its requests back for no room); None when no running request
        holds one."""
        ends: dict[str, int] = {}
        residency = self.adapters.residency
        for r in running:
            adapter_id = r.spec.adapter_id
            if (
                r.holds_adapter
                and adapter_id is not None
                and adapter_id != self.adapters.merged
                and not residency.is_pinned(adapter_id)
            ):
                ends[adapter_id] = max(ends.get(adapter_id, 0), self.tokens_left(r))
        return min(ends, key=lambda a: (ends[a], a)) if ends else None
