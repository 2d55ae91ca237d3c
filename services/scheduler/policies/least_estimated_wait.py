"""dLoRA proactive dispatch: the worker with the least estimated wait (queue + adapter load)."""

from __future__ import annotations

from services.scheduler.cluster_view import ClusterSnapshot
from services.scheduler.placement import PlacementDecision, PlacementRequest, WaitModel, eligible


class LeastEstimatedWait:
    """The worker with the least :meth:`WaitModel.estimate`.

    Ties (equal estimates, e.g. an idle cluster) go to the worker with the fewest requests
    running or placed there since its report, then to the smallest worker id, so decisions are
    deterministic and a burst spreads over idle workers instead of piling on the first.
    """

    name = "least-estimated-wait"

    def __init__(self, model: WaitModel | None = None):
        self.model = model or WaitModel()

    def estimates(self, snapshot: ClusterSnapshot, request: PlacementRequest) -> list[PlacementDecision]:
        """Every eligible worker's estimate, best first."""
        workers = {w.worker_id: w for w in eligible(snapshot, request)}

        def key(p: PlacementDecision) -> tuple[float, int, str]:
            w = workers[p.worker_id]
            return (round(p.estimated_wait_ms, 6), w.running + snapshot.placed(w.worker_id), w.worker_id)

        return sorted((self.model.estimate(snapshot, w, request) for w in workers.values()), key=key)

    def place(self, snapshot: ClusterSnapshot, request: PlacementRequest) -> PlacementDecision:
        return self.estimates(snapshot, request)[0]
