"""S-LoRA's adapter clustering (§4.2; spec in SEED-SPECS §5): at most ``max_adapters`` distinct
adapters in the running batch. The queue is admitted FCFS, skipping a request whose adapter would
exceed the cap, unless it has waited ``aging_s``: then it goes in regardless, so a rare adapter
is delayed, never starved. Fewer adapters per step mean fewer LoRA segments to compute and fewer
adapter pages, which leaves room for larger batches; the price is latency and fairness.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gpu_worker.engine.policies.batch_policy import BatchPlan, BatchView, StepOutcome


@dataclass(frozen=True)
class AdapterClusteringConfig:
    """The cap and its escape hatch."""

    max_adapters: int = 4
    """Distinct adapters in the running batch at most (the base model does not count)."""
    aging_s: float = 2.0
    """A request that waited this long is admitted even past the cap."""

    def __post_init__(self) -> None:
        if self.max_adapters < 1:
            raise ValueError(f"max_adapters must be >= 1, got {self.max_adapters}")
        if self.aging_s < 0:
            raise ValueError(f"aging_s must be >= 0, got {self.aging_s}")


class AdapterClustering:
    """FCFS under a cap on distinct adapters per batch, with aging."""

    name = "adapter_clustering"

    def __init__(self, config: AdapterClusteringConfig = AdapterClusteringConfig()):
        self.config = config
        self.skipped = 0
        """Admissions deferred by the cap so far (exported as a metric)."""

    def plan(self, view: BatchView) -> BatchPlan:
        adapters = {r.adapter_id for r in view.running if r.adapter_id is not None}
        run = [r.request_id for r in view.running]
        deferred: list[str] = []
        for request in view.waiting:
            if len(run) >= view.max_running:
                break
            new_adapter = request.adapter_id is not None and request.adapter_id not in adapters
            aged = view.now_s - request.arrived_s >= self.config.aging_s
            if new_adapter and len(adapters) >= self.config.max_adapters and not aged:
                deferred.append(request.request_id)
                continue
            if request.adapter_id is not None:
                adapters.add(request.adapter_id)
            run.append(request.request_id)
        self.skipped += len(deferred)
        return BatchPlan(run=tuple(run))

    def observe(self, outcome: StepOutcome) -> None:
        """The cap is fixed; nothing to learn."""

    def decisions(self) -> dict[str, float]:
        return {"skipped_by_cap": self.skipped}
