"""Last come, first served: the newest waiting request is admitted first (S-LoRA's baseline for
early abort, good when bursts are short: the newest request is the one still within its SLO)."""

from __future__ import annotations

from services.gpu_worker.engine.policies.batch_policy import BatchPlan, BatchView, StepOutcome


class Lcfs:
    """The running batch keeps stepping; the queue is admitted newest first."""

    name = "lcfs"

    def plan(self, view: BatchView) -> BatchPlan:
        newest_first = sorted(view.waiting, key=lambda r: r.arrived_s, reverse=True)
        return BatchPlan(
            run=tuple(r.request_id for r in view.running) + tuple(r.request_id for r in newest_first)
        )

    def observe(self, outcome: StepOutcome) -> None:
        """LCFS learns nothing."""

    def decisions(self) -> dict[str, float]:
        return {}
