"""Magnus' highest response ratio next (SEED-SPECS §3, arXiv 2406.04785 §4.4), per request in
our continuous batching: the waiting request with the highest ``(wait + S) / S`` is admitted
first, ``S`` its predicted service time.

``S = prefill + G′ · decode step``: the prefill of its prompt and G′ decode steps (G′ its
predicted output length, carried on the request) beside the running batch, both from the online
step cost model (the continuous engine's batch-time estimator). Short requests go first, as
under SJF, but a long one's ratio grows with its wait, so it is never starved. Preempted
requests (they produced tokens already) go first, oldest first, as under FCFS.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gpu_worker.engine.policies.batch_policy import BatchPlan, BatchView, QueuedRequest, StepOutcome
from services.gpu_worker.engine.policies.linear_cost import OnlineFit
from services.gpu_worker.engine.policies.step_cost_model import step_cost_model, step_row


@dataclass(frozen=True)
class HrrnConfig:
    """What HRRN assumes of a request that carries no prediction."""

    default_output_tokens: int = 128
    """G′ of a request without a predicted length."""

    def __post_init__(self) -> None:
        if self.default_output_tokens < 1:
            raise ValueError(f"default_output_tokens must be >= 1, got {self.default_output_tokens}")


class Hrrn:
    """The running batch keeps stepping; the queue is admitted by highest response ratio."""

    name = "hrrn"

    def __init__(self, config: HrrnConfig = HrrnConfig(), cost: OnlineFit[StepOutcome] | None = None):
        self.config = config
        self.cost = cost or step_cost_model()
        self.reordered = 0
        """Steps whose admission order differed from FCFS (exported as a metric)."""

    def plan(self, view: BatchView) -> BatchPlan:
        started = [r for r in view.waiting if r.started]
        fresh = [r for r in view.waiting if not r.started]
        decodes = min(view.max_running, len(view.running) + 1)
        ranked = sorted(fresh, key=lambda r: -self.response_ratio(r, view.now_s, decodes))
        if ranked != fresh:
            self.reordered += 1
        return BatchPlan(
            run=tuple(r.request_id for r in view.running) + tuple(r.request_id for r in (*started, *ranked))
        )

    def observe(self, outcome: StepOutcome) -> None:
        self.cost.observe(outcome)

    def decisions(self) -> dict[str, float]:
        return {"reordered_steps": self.reordered}

    def service_s(self, request: QueuedRequest, decodes: int) -> float:
        """Predicted seconds from its admission to its last token, beside ``decodes`` requests."""
        adapters = 0 if request.adapter_id is None else 1
        tokens = request.predicted_output_tokens or self.config.default_output_tokens
        prefill = self.cost.cost.predict(step_row(request.prefill_tokens, decodes - 1, adapters))
        step = self.cost.cost.predict(step_row(0, decodes, adapters))
        return max(1e-6, prefill + tokens * step)

    def response_ratio(self, request: QueuedRequest, now_s: float, decodes: int) -> float:
        service = self.service_s(request, decodes)
        return (max(0.0, now_s - request.arrived_s) + service) / service
