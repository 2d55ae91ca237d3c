"""Least-loaded placement: the fewest requests queued, running or placed since the report."""

from __future__ import annotations

from services.scheduler.cluster_view import ClusterSnapshot
from services.scheduler.placement import PlacementDecision, PlacementRequest, WaitModel, eligible


class LeastLoaded:
    """The worker with the fewest requests (queue + running + placed since its report); ties go
    to the smallest id. Blind to adapter residency and to how fast each worker drains, which is
    what least-estimated-wait adds."""

    name = "least-loaded"

    def __init__(self, model: WaitModel | None = None):
        self.model = model or WaitModel()

    def place(self, snapshot: ClusterSnapshot, request: PlacementRequest) -> PlacementDecision:
        chosen = min(
            eligible(snapshot, request),
            key=lambda w: (w.queue + w.running + snapshot.placed(w.worker_id), w.worker_id),
        )
        return self.model.estimate(snapshot, chosen, request)
