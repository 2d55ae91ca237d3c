"""First come, first served, always unmerged: the engine's behaviour before batch policies."""

from __future__ import annotations

from services.gpu_worker.engine.policies.batch_policy import BatchPlan, BatchView, StepOutcome, fcfs_ids


class Fcfs:
    """The running batch keeps stepping; the queue is admitted oldest first."""

    name = "fcfs"

    def plan(self, view: BatchView) -> BatchPlan:
        return BatchPlan(run=fcfs_ids(view))

    def observe(self, outcome: StepOutcome) -> None:
        """FCFS learns nothing."""

    def decisions(self) -> dict[str, float]:
        return {}
