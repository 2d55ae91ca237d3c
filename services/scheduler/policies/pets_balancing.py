"""PetS migration-based load balancing (Alg. 3) with the adaptive interval.

PetS (seed 002, §2.3.2) balances the per-instance task invocations of a window greedily: move
the least-invoked task of the most-loaded instance to the least-loaded one, and repeat while the
gap ``X_max − X_min`` shrinks. Here a task is an adapter and moving it means loading it on the
target and sending its queued requests there (as their tokens, like every migration here);
only adapters with queued requests on the loaded instance can move — moving one with none
changes nothing in a continuous-batching server.

The interval between rounds adapts to the imbalance ``φ = L_min / L_max`` of the instances'
queue lengths against ``θ``: ``φ < θ`` halves it (down to ``min_interval_s``), otherwise it grows
by ``step_s`` (up to ``max_interval_s``; the seed's ``max`` there is a typo for ``min``).
Defaults are the paper's: 0.2 s, 20 s, θ = 0.9, Δ = 0.5 s, starting from the fixed 10 s.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from services.scheduler.policies.replica_load import ClusterLoad, Migration


@dataclass(frozen=True)
class PetsBalancingConfig:
    """The adaptive interval's parameters (PetS L187)."""

    initial_interval_s: float = 10.0
    """Interval before the first adaptation (PetS's fixed baseline)."""
    min_interval_s: float = 0.2
    """Shortest interval (i_min)."""
    max_interval_s: float = 20.0
    """Longest interval (i_max)."""
    step_s: float = 0.5
    """Growth of the interval when balanced (Δ)."""
    theta: float = 0.9
    """Worst tolerated imbalance φ = L_min / L_max."""
    max_moves: int = 64
    """Adapters moved per round at most (each step of Alg. 3 moves one)."""

    def __post_init__(self) -> None:
        values = (self.initial_interval_s, self.min_interval_s, self.max_interval_s, self.step_s)
        if not all(math.isfinite(v) and v > 0 for v in values):
            raise ValueError(f"intervals and step must be > 0, got {values}")
        if not self.min_interval_s <= self.initial_interval_s <= self.max_interval_s:
            raise ValueError("need min_interval_s <= initial_interval_s <= max_interval_s")
        if not 0 < self.theta <= 1:
            raise ValueError(f"theta must be in (0, 1], got {self.theta}")
        if self.max_moves < 1:
            raise ValueError(f"max_moves must be >= 1, got {self.max_moves}")


def imbalance(cluster: ClusterLoad) -> float:
    """φ = L_min / L_max over the replicas' queue lengths (1 when nothing is queued anywhere)."""
    loads = [sum(1 for q in r.requests if not q.running) for r in cluster.replicas]
    top = max(loads, default=0)
    return 1.0 if top == 0 else min(loads) / top


class PetsBalancing:
    name = "pets"

    def __init__(self, config: PetsBalancingConfig | None = None):
        self.config = config or PetsBalancingConfig()
        self._interval = self.config.initial_interval_s

    def interval_s(self) -> float:
        return self._interval

    def adapt(self, phi: float) -> float:
        """The next interval after observing imbalance ``phi``."""
        cfg = self.config
        if phi < cfg.theta:
            self._interval = max(cfg.min_interval_s, self._interval / 2)
        else:
            self._interval = min(self._interval + cfg.step_s, cfg.max_interval_s)
        return self._interval

    def plan(self, cluster: ClusterLoad) -> list[Migration]:
        self.adapt(imbalance(cluster))
        tasks = {r.worker_id: Counter(r.invocations) for r in cluster.replicas}
        queued = {
            r.worker_id: {q.adapter_id for q in r.requests if not q.running and q.adapter_id}
            for r in cluster.replicas
        }
        moved: list[tuple[str, str, str]] = []
        while len(moved) < self.config.max_moves and len(tasks) > 1:
            totals = {w: sum(t.values()) for w, t in tasks.items()}
            low = min(totals, key=lambda w: (totals[w], w))
            high = max(totals, key=lambda w: (totals[w], w))
            candidates = [a for a in queued[high] if tasks[high][a] > 0]
            if not candidates:
                break
            task = min(candidates, key=lambda a: (tasks[high][a], a))
            count = tasks[high][task]
            gap = totals[high] - totals[low]
            after = dict(totals, **{high: totals[high] - count, low: totals[low] + count})
            if max(after.values()) - min(after.values()) >= gap:
                break  # no better: stop (Alg. 3 line 9)
            tasks[high][task] -= count
            tasks[low][task] += count
            queued[high].discard(task)
            moved.append((task, high, low))
        by_id = {r.worker_id: r for r in cluster.replicas}
        return [
            Migration(q.request_id, task, high, low)
            for task, high, low in moved
            for q in by_id[high].requests
            if not q.running and q.adapter_id == task
        ]
