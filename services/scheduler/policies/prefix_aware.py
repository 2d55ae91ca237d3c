"""Prefix-aware placement: adapter residency and load, as least-estimated-wait, plus the prompt
tokens each worker likely holds in its prefix cache (SGLang's cache-aware router, llm-d's
prefix-cache scorer; here with adapter-aware keys).

Each eligible worker ``w`` gets a cost in milliseconds, and the cheapest wins::

    cost(w) = wait(w)                                         queueing + adapter load (WaitModel)
            + prefill_ms_per_token · (prompt_tokens − hit(w))   the prefill left to compute there
            + imbalance_ms_per_request · (load(w) − min load)   its load above the least-loaded
              where hit(w) > 0                                   one, charged to cache holders

``wait(w)`` is :meth:`WaitModel.estimate`: the requests ahead of this one and the batch it joins,
plus the adapter's load time where the adapter is not resident (what least-estimated-wait
minimises). ``hit(w)`` is the request's prompt tokens the scheduler's
:class:`~services.scheduler.prefix_index.PrefixIndex` says ``w`` likely holds
(``ClusterSnapshot.prefix_hit_tokens``): the hit tokens are prefill saved. ``load(w)`` is
queued + running + placed since its report; the last term keeps one worker that holds a popular
prefix from drawing every request for it while others idle (the hit saving is bounded, the
queue it builds is not). It is charged only where a cached prefix is the pull, so with no hit
anywhere (a prompt shared with nothing, a gateway sending no blocks) the choice is exactly
least-estimated-wait's. The first two terms are an estimate of the time to the first token;
with both weights 0 the policy is least-estimated-wait too. Ties go to the worker with the
fewest requests running or placed since its report, then the smallest id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.scheduler.cluster_view import ClusterSnapshot, WorkerState
from services.scheduler.placement import PlacementDecision, PlacementRequest, WaitModel, eligible


@dataclass(frozen=True)
class PrefixAwareConfig:
    """The weights of prefix-aware placement's cost (module docstring)."""

    prefill_ms_per_token: float = 1.0
    """What prefilling one prompt token costs a worker, in ms: turns the tokens a cached prefix
    saves into time. The default is the CPU worker's order of magnitude (SmolLM2-135M, a few
    threads); a GPU worker prefills a token in ~0.01-0.1 ms. 0: prefixes are ignored."""
    imbalance_ms_per_request: float = 50.0
    """Cost of each request a worker that likely holds part of the prompt has (queued, running,
    placed) above the least-loaded eligible worker, in ms, beside the wait model's own queueing
    estimate: how much cache affinity may pile onto one worker. 0: the hit saving against the
    wait estimate alone."""

    def __post_init__(self) -> None:
        for name in ("prefill_ms_per_token", "imbalance_ms_per_request"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"PrefixAwareConfig.{name} must be a finite number >= 0, got {value}")


class PrefixAware:
    """The worker of least :meth:`cost`: wait + prefill left after its likely cached prefix + a
    penalty per request above the least-loaded worker where a cached prefix draws it."""

    name = "prefix-aware"

    def __init__(self, model: WaitModel | None = None, config: PrefixAwareConfig | None = None):
        self.model = model or WaitModel()
        self.config = config or PrefixAwareConfig()

    @staticmethod
    def load(snapshot: ClusterSnapshot, worker: WorkerState) -> int:
        """Requests queued, running and placed since the report on ``worker``."""
        return worker.queue + worker.running + snapshot.placed(worker.worker_id)

    def cost(self, decision: PlacementDecision, request: PlacementRequest, load_above_min: int) -> float:
        """The cost of ``decision`` (a worker's wait estimate) for ``request``, ms."""
        hit = decision.cached_prefix_tokens
        imbalance = self.config.imbalance_ms_per_request * load_above_min if hit > 0 else 0.0
        return (
            decision.estimated_wait_ms
            + self.config.prefill_ms_per_token * max(0, request.prompt_tokens - hit)
            + imbalance
        )

    def place(self, snapshot: ClusterSnapshot, request: PlacementRequest) -> PlacementDecision:
        workers = eligible(snapshot, request)
        loads = {w.worker_id: self.load(snapshot, w) for w in workers}
        least = min(loads.values())

        def key(w: WorkerState) -> tuple[float, int, str]:
            decision = self.model.estimate(snapshot, w, request)
            cost = self.cost(decision, request, loads[w.worker_id] - least)
            return (round(cost, 6), w.running + snapshot.placed(w.worker_id), w.worker_id)

        return self.model.estimate(snapshot, min(workers, key=key), request)
