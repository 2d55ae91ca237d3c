"""Admission control: refuse at once what cannot be served in time (S-LoRA early abort, DESIGN §7).

A request is refused with :class:`~services.runtime.errors.ResourceExhausted` (and a
``retry_after_s`` hint) when

- every eligible worker's queue — reported queue plus what this scheduler placed there since the
  report — is at ``max_queue_per_worker``; or
- the chosen worker cannot start it before its first-token deadline (the estimated wait is over
  the deadline; with :class:`~services.scheduler.policies.least_estimated_wait.LeastEstimatedWait` that means no
  worker can).

With no live worker (or every live one excluded) the answer is
:class:`~services.runtime.errors.Unavailable`. Whether the adapter exists is the gateway's
business, not ours. Pure: a function of the snapshot and the request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.runtime.errors import ResourceExhausted
from services.scheduler.cluster_view import ClusterSnapshot
from services.scheduler.placement import PlacementDecision, PlacementRequest, WaitModel, eligible
from services.scheduler.policies.interface import PlacementPolicy


@dataclass(frozen=True)
class AdmissionConfig:
    """Limits admission enforces."""

    max_queue_per_worker: int = 64
    """A worker with this many requests queued (reported + placed since) takes no more."""
    default_deadline_ms: float = 0.0
    """First-token deadline for requests that carry none; 0: none."""
    min_retry_after_s: float = 0.05
    """Smallest retry hint given with a refusal."""

    def __post_init__(self) -> None:
        if self.max_queue_per_worker < 1:
            raise ValueError(f"max_queue_per_worker must be >= 1, got {self.max_queue_per_worker}")
        if not math.isfinite(self.default_deadline_ms) or self.default_deadline_ms < 0:
            raise ValueError(f"default_deadline_ms must be >= 0 (0: none), got {self.default_deadline_ms}")
        if not math.isfinite(self.min_retry_after_s) or self.min_retry_after_s < 0:
            raise ValueError(f"min_retry_after_s must be >= 0, got {self.min_retry_after_s}")


class AdmissionControl:
    """Wraps a placement policy with early rejection; :meth:`place` is what the service calls."""

    def __init__(self, config: AdmissionConfig | None = None, model: WaitModel | None = None):
        self.config = config or AdmissionConfig()
        self.model = model or WaitModel()

    def deadline_ms(self, request: PlacementRequest) -> float:
        """The request's first-token deadline, or the default; 0: none."""
        return request.first_token_deadline_ms or self.config.default_deadline_ms

    def open_snapshot(self, snapshot: ClusterSnapshot, request: PlacementRequest) -> ClusterSnapshot:
        """The snapshot restricted to eligible workers whose queue is below the bound.

        Raises Unavailable (no eligible worker) or ResourceExhausted (every queue full).
        """
        workers = eligible(snapshot, request)
        bound = self.config.max_queue_per_worker
        full = [w for w in workers if w.queue + snapshot.placed(w.worker_id) >= bound]
        if len(full) < len(workers):
            excluded = set(request.exclude_workers) | {w.worker_id for w in full}
            return snapshot.without(frozenset(excluded))
        # Retry when the first worker has drained below the bound.
        retry_ms = min(
            (w.queue + snapshot.placed(w.worker_id) - bound + 1) * self.model.service_interval_ms(w)
            for w in full
        )
        detail = ", ".join(f"{w.worker_id} {w.queue}+{snapshot.placed(w.worker_id)}" for w in full[:8])
        more = f" and {len(full) - 8} more" if len(full) > 8 else ""
        raise ResourceExhausted(
            f"every gpu_worker queue is full: {len(full)} worker(s) at or over the bound of {bound} "
            f"queued requests (reported+placed: {detail}{more})",
            retry_after_s=self._retry(retry_ms),
        )

    def check_deadline(self, request: PlacementRequest, placement: PlacementDecision) -> None:
        """ResourceExhausted when ``placement`` cannot start the request before its deadline."""
        deadline = self.deadline_ms(request)
        if deadline <= 0 or placement.estimated_wait_ms <= deadline:
            return
        raise ResourceExhausted(
            f"no gpu_worker can start the request within its first-token deadline of {deadline:.0f} ms: "
            f"the least estimated wait is {placement.estimated_wait_ms:.0f} ms on {placement.worker_id} "
            f"({placement.ahead} request(s) ahead, {placement.queue_wait_ms:.0f} ms queueing + "
            f"{placement.adapter_load_ms:.0f} ms adapter load)",
            retry_after_s=self._retry(placement.estimated_wait_ms - deadline),
        )

    def place(
        self, policy: PlacementPolicy, snapshot: ClusterSnapshot, request: PlacementRequest
    ) -> PlacementDecision:
        """Admit and place: open workers only, the policy's pick (or the migration target the
        request prefers, while it is open), then the deadline check."""
        open_workers = self.open_snapshot(snapshot, request)
        preferred = open_workers.worker(request.prefer_worker) if request.prefer_worker else None
        if preferred is not None:
            placement = self.model.estimate(open_workers, preferred, request)
        else:
            placement = policy.place(open_workers, request)
        self.check_deadline(request, placement)
        return placement

    def _retry(self, ms: float) -> float:
        return max(self.config.min_retry_after_s, ms / 1000.0)
