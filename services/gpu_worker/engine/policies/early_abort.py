"""S-LoRA's early abort (§4.3; reconstruction in SEED-SPECS §5): when the queue is longer than
the first-token SLO allows, serve the newest requests that can still make it, in arrival order,
and abort the older ones at once instead of letting them occupy the batch after their SLO is lost.

With the not-yet-started queue q_1..q_n (oldest first) and δ_j the estimated time to q_j's first
token once it is next, the policy keeps the smallest k such that every q_i with i ≥ k meets
``now + δ_k + ... + δ_i − arrived_i ≤ slo`` and aborts q_1..q_{k−1}. δ_j comes from the online
step cost model: a step that prefills q_j beside the running batch's decodes. Preempted requests
(they had their first token) are never aborted; they go first and their recompute counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gpu_worker.engine.policies.batch_policy import (
    Abort,
    BatchPlan,
    BatchView,
    QueuedRequest,
    StepOutcome,
)
from services.gpu_worker.engine.policies.step_cost_model import StepCostModel


@dataclass(frozen=True)
class EarlyAbortConfig:
    """S-LoRA's first-token SLO."""

    first_token_slo_s: float = 6.0
    """Seconds from arrival to the first token (S-LoRA's evaluation uses 6 s)."""

    def __post_init__(self) -> None:
        if self.first_token_slo_s <= 0:
            raise ValueError(f"first_token_slo_s must be > 0, got {self.first_token_slo_s}")


class EarlyAbort:
    """FCFS over the requests that can still meet their first-token SLO; abort the rest."""

    name = "early_abort"

    def __init__(self, config: EarlyAbortConfig = EarlyAbortConfig(), cost: StepCostModel | None = None):
        self.config = config
        self.cost = cost or StepCostModel()
        self.aborted = 0
        """Requests aborted so far (exported as a metric)."""

    def plan(self, view: BatchView) -> BatchPlan:
        started = [r for r in view.waiting if r.started]
        fresh = [r for r in view.waiting if not r.started]
        decodes = len(view.running)
        ahead = sum(self._first_token_s(r, decodes) for r in started)
        keep_from = self._oldest_servable(view.now_s + ahead, fresh, decodes)
        aborts = tuple(Abort(r.request_id, self._reason(view.now_s, r)) for r in fresh[:keep_from])
        self.aborted += len(aborts)
        kept = [*started, *fresh[keep_from:]]
        return BatchPlan(
            run=tuple(r.request_id for r in view.running) + tuple(r.request_id for r in kept),
            aborts=aborts,
        )

    def observe(self, outcome: StepOutcome) -> None:
        self.cost.observe(outcome)

    def decisions(self) -> dict[str, float]:
        return {"aborted": self.aborted}

    def _first_token_s(self, request: QueuedRequest, decodes: int) -> float:
        adapters = 0 if request.adapter_id is None else 1
        return self.cost.cost.seconds(request.prefill_tokens, decodes, adapters)

    def _oldest_servable(self, start_s: float, fresh: list[QueuedRequest], decodes: int) -> int:
        """The smallest k such that fresh[k:], served in order from ``start_s``, all meet the SLO.

        Scanning k upwards, the finish times of fresh[k:] only move earlier, so the first k that
        works is the answer; an O(n) pass per k keeps it simple for queues of a few hundred."""
        slo = self.config.first_token_slo_s
        deltas = [self._first_token_s(r, decodes) for r in fresh]
        for k in range(len(fresh)):
            t = start_s
            for request, delta in zip(fresh[k:], deltas[k:]):
                t += delta
                if t - request.arrived_s > slo:
                    break
            else:
                return k
        return len(fresh)

    def _reason(self, now_s: float, request: QueuedRequest) -> str:
        return (
            f"aborted early: its first token cannot come within the {self.config.first_token_slo_s:g} s "
            f"SLO (it waited {now_s - request.arrived_s:.2f} s and newer requests can still make theirs)"
        )
