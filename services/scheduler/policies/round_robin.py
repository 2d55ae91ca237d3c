"""Round-robin placement: the baseline that ignores load and adapter residency."""

from __future__ import annotations

from services.scheduler.cluster_view import ClusterSnapshot
from services.scheduler.placement import PlacementDecision, PlacementRequest, WaitModel, eligible


class RoundRobin:
    """Each request goes to the next eligible worker in id order after the previous pick.

    The cursor is the last worker id chosen, not an index, so workers joining or leaving do not
    make it skip or repeat the others. The returned estimate is the wait model's, for admission.
    """

    name = "round-robin"

    def __init__(self, model: WaitModel | None = None):
        self.model = model or WaitModel()
        self._last = ""

    def place(self, snapshot: ClusterSnapshot, request: PlacementRequest) -> PlacementDecision:
        workers = eligible(snapshot, request)  # sorted by id
        chosen = next((w for w in workers if w.worker_id > self._last), workers[0])
        self._last = chosen.worker_id
        return self.model.estimate(snapshot, chosen, request)
