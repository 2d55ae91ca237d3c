"""dLoRA proactive prefetch: replicate the adapters least able to absorb a burst.

dLoRA (seed 001, "Inter-replica: Proactive mechanism") defines an adapter's burst tolerance as
its peak capacity over its average load, where peak capacity is the number of requests the
unallocated memory of the replicas holding it can serve::

    peak_capacity(l) = Σ_{j holds l} headroom_j / mean_request_tokens         (requests)
    burst_tolerance(l) = peak_capacity(l) / rate(l)                            (seconds of demand)

and periodically loads the lowest-tolerance adapters onto replicas that lack them. An adapter
held nowhere has tolerance 0. We prefetch only adapters in demand (rate > 0) whose tolerance is
under ``max_tolerance_s``, lowest first, at most ``max_per_round`` per round, each onto the
replica lacking it with the most headroom, if that holds the adapter plus one request.

Memory is what a continuous-batching pool runs out of first (its running requests' KV grows by a
token a step), so a replica's *headroom* is its free pool less the KV its running requests will
still grow into; a replica with no headroom absorbs no burst, and an adapter prefetched there
would only be evicted again (or take room from the requests already running).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.scheduler.policies.replica_load import ClusterLoad, Prefetch, ReplicaLoad


@dataclass(frozen=True)
class BurstToleranceConfig:
    """Knobs of the prefetch policy ([our choice]: the seed gives no values)."""

    interval_s: float = 2.0
    """Seconds between prefetch rounds."""
    max_tolerance_s: float = 4.0
    """Adapters whose holders' free memory absorbs less than this many seconds of their demand
    get another replica."""
    max_per_round: int = 8
    """Adapters prefetched per round at most (bounds the load put on the adapter store)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        if not (math.isfinite(self.max_tolerance_s) and self.max_tolerance_s >= 0):
            raise ValueError(f"max_tolerance_s must be >= 0, got {self.max_tolerance_s}")
        if self.max_per_round < 1:
            raise ValueError(f"max_per_round must be >= 1, got {self.max_per_round}")


def headroom(replica: ReplicaLoad) -> int:
    """Free pool left once its running requests' KV has grown to their last token."""
    growth = sum(q.remaining_tokens for q in replica.requests if q.running)
    return max(0, replica.free_tokens - growth)


def burst_tolerances(cluster: ClusterLoad) -> dict[str, float]:
    """``adapter -> burst tolerance`` (s) for every adapter with a positive rate."""
    per_request = max(1.0, cluster.mean_request_tokens)
    room = {r.worker_id: headroom(r) for r in cluster.replicas}
    tolerance = {}
    for adapter, rate in cluster.adapter_rates.items():
        if rate <= 0:
            continue
        free = sum(room[r.worker_id] for r in cluster.replicas if adapter in r.resident_adapters)
        tolerance[adapter] = (free / per_request) / rate
    return tolerance


class BurstTolerancePrefetch:
    name = "burst-tolerance"

    def __init__(self, config: BurstToleranceConfig | None = None):
        self.config = config or BurstToleranceConfig()
        self.interval_s = self.config.interval_s

    def plan(self, cluster: ClusterLoad) -> list[Prefetch]:
        tolerance = burst_tolerances(cluster)
        # Lowest tolerance first; at equal tolerance the busier adapter, then the name.
        ranked = sorted(tolerance, key=lambda a: (tolerance[a], -cluster.adapter_rates[a], a))
        free = {r.worker_id: headroom(r) for r in cluster.replicas}
        orders: list[Prefetch] = []
        for adapter in ranked:
            if tolerance[adapter] >= self.config.max_tolerance_s or len(orders) >= self.config.max_per_round:
                break
            size = cluster.adapter_sizes.get(adapter, 0)
            lacking = [r.worker_id for r in cluster.replicas if adapter not in r.resident_adapters]
            if not lacking:
                continue
            target = max(lacking, key=lambda w: (free[w], w))
            if free[target] < size + cluster.mean_request_tokens:
                continue
            free[target] -= size
            orders.append(Prefetch(adapter, target))
        return orders
