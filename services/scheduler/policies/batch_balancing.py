"""Batch balancing: move running requests from the largest running batches to the smallest.

In a continuous-batching server a step takes ``base + per_token · b + per_adapter · a`` for a
batch of ``b`` requests of ``a`` distinct adapters, so a request's decode time grows with the
batch it sits in. When one replica runs a much larger batch than another, moving one of its
running requests (as its tokens: the target recomputes its context) shortens the remaining steps
of the request and of the batch it leaves, and lengthens the target's. A move is made only when
the model says the request-seconds saved exceed those spent (the recompute stalls the target's
batch and the moved request; a fetch the moved request waits for); each round moves at most
``max_moves`` requests, the best first, and only to a replica with a free slot after its queue
and free memory for the request's context and the tokens it still has to generate. The default
costs are the CPU calibration's of ``bench/cluster_sim/calibrations/`` (``bench/HISTORY.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.scheduler.policies.replica_load import ClusterLoad, Migration, ReplicaLoad, RequestLoad


@dataclass(frozen=True)
class BatchBalancingConfig:
    """The step model and the limits of one round."""

    interval_s: float = 1.0
    """Seconds between rounds."""
    min_gap: int = 4
    """Running batches must differ by at least this many requests for a move to be considered."""
    max_moves: int = 8
    """Requests moved per round at most."""
    step_token_ms: float = 8.08
    """How much one more request in the running batch lengthens every step (its decode token)."""
    step_adapter_ms: float = 18.4
    """How much one more distinct adapter in the running batch lengthens every step."""
    prefill_token_ms: float = 8.07
    """Cost of recomputing one context token at the target (its step is that much longer)."""
    adapter_load_s: float = 0.644
    """Time the moved request waits for its adapter on a target that holds no copy."""
    default_max_running: int = 32
    """Batch limit of a replica that reports none."""

    def __post_init__(self) -> None:
        values = (
            self.interval_s,
            self.step_token_ms,
            self.step_adapter_ms,
            self.prefill_token_ms,
            self.adapter_load_s,
        )
        if not all(math.isfinite(v) and v >= 0 for v in values) or self.interval_s <= 0:
            raise ValueError(f"interval must be > 0 and costs >= 0, got {values}")
        if self.min_gap < 2 or self.max_moves < 1 or self.default_max_running < 1:
            raise ValueError("need min_gap >= 2, max_moves >= 1, default_max_running >= 1")


@dataclass
class _Replica:
    """A replica as the round plans it (its batch and memory after the moves so far)."""

    load: ReplicaLoad
    running: list[RequestLoad]
    queued: int
    free_tokens: int
    max_running: int

    @property
    def batch(self) -> int:
        return len(self.running)

    def free_slots(self) -> int:
        return self.max_running - self.batch - self.queued

    def sharing(self, adapter: str) -> int:
        """Running requests of ``adapter`` here."""
        return sum(1 for r in self.running if r.adapter_id == adapter) if adapter else 0


class BatchBalancing:
    name = "batch-balancing"

    def __init__(self, config: BatchBalancingConfig | None = None):
        self.config = config or BatchBalancingConfig()

    def interval_s(self) -> float:
        return self.config.interval_s

    def gain_s(self, request: RequestLoad, source: _Replica, target: _Replica, holds_adapter: bool) -> float:
        """Request-seconds the move saves (negative: it costs) under the step model."""
        cfg = self.config
        token_s, adapter_s = cfg.step_token_ms / 1000.0, cfg.step_adapter_ms / 1000.0

        def step_s(replica: _Replica) -> float:  # without the fixed part, which both steps have
            adapters = {r.adapter_id for r in replica.running if r.adapter_id}
            return token_s * replica.batch + adapter_s * len(adapters)

        leaves_s = token_s + (adapter_s if source.sharing(request.adapter_id) == 1 else 0.0)
        joins_s = token_s + (
            adapter_s if request.adapter_id and not target.sharing(request.adapter_id) else 0.0
        )
        steps = request.remaining_tokens
        own = steps * (step_s(source) - step_s(target) - joins_s)
        # The requests left behind save the moved one's share of every step they share with it;
        # those at the target pay it.
        left = sum(min(r.remaining_tokens, steps) for r in source.running if r is not request)
        joined = sum(min(r.remaining_tokens, steps) for r in target.running)
        recompute_s = request.context_tokens * cfg.prefill_token_ms / 1000.0
        fetch_s = 0.0 if holds_adapter else cfg.adapter_load_s
        return own + leaves_s * left - joins_s * joined - recompute_s * (target.batch + 1) - fetch_s

    def plan(self, cluster: ClusterLoad) -> list[Migration]:
        cfg = self.config
        replicas = [
            _Replica(
                load=r,
                running=[q for q in r.requests if q.running],
                queued=sum(1 for q in r.requests if not q.running),
                free_tokens=r.free_tokens,
                max_running=r.max_running or cfg.default_max_running,
            )
            for r in cluster.replicas
        ]
        moves: list[Migration] = []
        while len(moves) < cfg.max_moves and len(replicas) > 1:
            source = max(replicas, key=lambda r: (r.batch, r.load.worker_id))
            targets = [r for r in replicas if r.free_slots() > 0 and source.batch - r.batch >= cfg.min_gap]
            best: tuple[float, RequestLoad, _Replica] | None = None
            for target in sorted(targets, key=lambda r: (r.batch, r.load.worker_id)):
                for request in source.running:
                    holds = not request.adapter_id or request.adapter_id in target.load.resident_adapters
                    adapter = 0 if holds else target.load.adapter_tokens.get(request.adapter_id, 0)
                    if request.context_tokens + request.remaining_tokens + adapter > target.free_tokens:
                        continue
                    gain = self.gain_s(request, source, target, holds)
                    if gain > 0 and (best is None or gain > best[0]):
                        best = (gain, request, target)
            if best is None:
                break
            _, request, target = best
            source.running.remove(request)
            source.free_tokens += request.context_tokens
            target.running.append(request)
            target.free_tokens -= request.context_tokens + request.remaining_tokens
            moves.append(
                Migration(
                    request.request_id, request.adapter_id, source.load.worker_id, target.load.worker_id
                )
            )
        return moves
