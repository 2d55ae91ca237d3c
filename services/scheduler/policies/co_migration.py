"""dLoRA reactive adapter–request co-migration: a relaxed ILP over the top-K replicas.

dLoRA (seed 001, "Reactive Migration") states the problem in words: place requests and adapters
to minimise the overall runtime across replicas, a request only where its adapter is, within
memory, each request on one replica; solve it only when a replica crosses a memory or queueing
threshold, only over the top-K overloaded and top-K underloaded replicas, with the 0/1 variables
relaxed to [0, 1], each request then going to the column of its largest value (L193).
Reconstruction (SEED-SPECS §2), over the chosen replicas J and the requests R of the overloaded
ones (the underloaded ones' requests stay: their load is ``fixed_j``)::

    min z + ε·Σ_{r, j≠src(r)} x_rj
    z ≥ fixed_j + Σ_r cost_rj·x_rj + Σ_{l ∉ res_j} load_l·y_lj          ∀ j ∈ J
    Σ_j x_rj = 1                                                        ∀ r
    x_rj ≤ y_{l(r)j}                                                    ∀ r, j with l(r) ∉ res_j
    Σ_{l ∉ res_j} size_l·y_lj + Σ_{r: src(r)≠j} kv_r·x_rj ≤ free_j       ∀ j ∈ J
    0 ≤ x, y ≤ 1

Costs are in token-steps, the model's unit of runtime: a request costs its remaining tokens, plus
``prefill_weight``·context for the prefill still ahead of it (a queued request anywhere; a running
one only where it moves, since a move recomputes its KV); an adapter load costs
``adapter_load_tokens``. ``ε`` keeps requests home when moving gains nothing.

Rounding. dLoRA sends each request to the column of its largest value. With the adapter
variables relaxed the LP likes to split requests almost evenly (x = 0.503 home, 0.497 away, so
that y = 0.497 pays half an adapter load) and the argmax then moves nothing; so we round the
LP's *flows* instead: ``round(Σ_r x_rj)`` requests go from each source to each target, those with
the largest ``x_rj`` (for an integral solution this is exactly the argmax). A repair pass then
keeps a move only if the target still has the memory for it (and its adapter) — so the plan
always satisfies the memory constraint — and is left less loaded than its source; the plan is
dropped unless it lowers the model's makespan below that of no migration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from services.scheduler.policies.replica_load import ClusterLoad, Migration, ReplicaLoad, RequestLoad

EPSILON = 1e-3
"""Weight of the stay-home tie-break, per moved request (tokens)."""


@dataclass(frozen=True)
class CoMigrationConfig:
    """Knobs of co-migration ([our choice]: the seed gives no values)."""

    interval_s: float = 1.0
    """Seconds between checks of the triggers."""
    top_k: int = 2
    """Overloaded and underloaded replicas considered (K of each)."""
    queue_delay_trigger_s: float = 1.0
    """Compute threshold: a replica whose queued requests have waited this long on average."""
    free_memory_trigger: float = 0.05
    """Memory threshold: a replica with less than this share of its pool free."""
    prefill_weight: float = 0.05
    """Cost of prefilling one context token relative to one decode step of one request."""
    adapter_load_tokens: float = 5.0
    """Cost of loading an adapter on a replica, in the same token-step units."""
    max_requests: int = 256
    """Requests of the overloaded replicas given to the LP at most (the costliest)."""

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.max_requests < 1:
            raise ValueError(f"top_k and max_requests must be >= 1, got {self.top_k}, {self.max_requests}")
        for name in ("interval_s", "queue_delay_trigger_s", "free_memory_trigger", "prefill_weight",
                     "adapter_load_tokens"):  # fmt: skip
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")


def request_cost(request: RequestLoad, moved: bool, config: CoMigrationConfig) -> float:
    """Token-steps the request adds to a replica's runtime (see the module docstring)."""
    prefill = config.prefill_weight * request.context_tokens if (moved or not request.running) else 0.0
    return request.remaining_tokens + prefill


def replica_cost(replica: ReplicaLoad, config: CoMigrationConfig) -> float:
    """The model's runtime of a replica with no migration."""
    return sum(request_cost(r, False, config) for r in replica.requests)


def makespan(
    replicas: tuple[ReplicaLoad, ...] | list[ReplicaLoad], moves: list[Migration], config: CoMigrationConfig,
    adapter_sizes: dict[str, int] | None = None,
) -> tuple[float, bool]:  # fmt: skip
    """The model's objective after ``moves``: max runtime over ``replicas``, and whether every
    replica's incoming requests and adapters fit its free memory."""
    by_id = {r.worker_id: r for r in replicas}
    cost = {w: replica_cost(r, config) for w, r in by_id.items()}
    incoming = dict.fromkeys(by_id, 0)
    loaded: set[tuple[str, str]] = set()
    requests = {(m.source, q.request_id): q for m in moves for q in by_id[m.source].requests}
    for move in moves:
        request = requests[(move.source, move.request_id)]
        cost[move.source] -= request_cost(request, False, config)
        cost[move.target] += request_cost(request, True, config)
        incoming[move.target] += request.context_tokens
        key = (move.target, request.adapter_id)
        if (
            request.adapter_id
            and request.adapter_id not in by_id[move.target].resident_adapters
            and key not in loaded
        ):
            loaded.add(key)
            cost[move.target] += config.adapter_load_tokens
            sizes = adapter_sizes or by_id[move.target].adapter_tokens
            incoming[move.target] += sizes.get(request.adapter_id, 0)
    fits = all(incoming[w] <= by_id[w].free_tokens for w in by_id)
    return max(cost.values(), default=0.0), fits


class CoMigration:
    name = "co-migration"

    def __init__(self, config: CoMigrationConfig | None = None):
        self.config = config or CoMigrationConfig()

    def interval_s(self) -> float:
        return self.config.interval_s

    def triggered(self, cluster: ClusterLoad) -> bool:
        """A replica crossed the queueing or the memory threshold."""
        cfg = self.config
        return any(
            r.queue_delay_s >= cfg.queue_delay_trigger_s
            or (r.memory_tokens > 0 and r.free_tokens < cfg.free_memory_trigger * r.memory_tokens)
            for r in cluster.replicas
        )

    def select(self, cluster: ClusterLoad) -> tuple[list[ReplicaLoad], list[ReplicaLoad]]:
        """Top-K overloaded (above the mean cost) and top-K underloaded (below it) replicas."""
        cost = {r.worker_id: replica_cost(r, self.config) for r in cluster.replicas}
        mean = sum(cost.values()) / max(1, len(cost))
        ranked = sorted(cluster.replicas, key=lambda r: (-cost[r.worker_id], r.worker_id))
        over = [r for r in ranked if cost[r.worker_id] > mean][: self.config.top_k]
        under = [r for r in reversed(ranked) if cost[r.worker_id] < mean][: self.config.top_k]
        return over, under

    def plan(self, cluster: ClusterLoad) -> list[Migration]:
        if not self.triggered(cluster):
            return []
        over, under = self.select(cluster)
        if not over or not under:
            return []
        return self.solve(over + under, over, dict(cluster.adapter_sizes))

    def solve(
        self, replicas: list[ReplicaLoad], sources: list[ReplicaLoad], sizes: dict[str, int]
    ) -> list[Migration]:
        """The relaxed LP over ``replicas`` moving requests of ``sources``, rounded and repaired."""
        cfg = self.config
        movable = sorted(
            ((src.worker_id, q) for src in sources for q in src.requests),
            key=lambda item: (-request_cost(item[1], False, cfg), item[0], item[1].request_id),
        )[: cfg.max_requests]
        if not movable:
            return []
        cols = [r.worker_id for r in replicas]
        by_id = {r.worker_id: r for r in replicas}
        n_x = len(movable) * len(cols)
        needs = sorted({(w, q.adapter_id) for _, q in movable for w in cols
                        if q.adapter_id and q.adapter_id not in by_id[w].resident_adapters})  # fmt: skip
        y_index = {key: n_x + i for i, key in enumerate(needs)}
        z = n_x + len(needs)
        c = np.zeros(z + 1)
        c[z] = 1.0
        fixed = {w: replica_cost(by_id[w], cfg) for w in cols}
        for w, q in movable:
            fixed[w] -= request_cost(q, False, cfg)
        rows, data, cells, bounds_ub = [], [], [], []

        def add(row: int, var: int, value: float) -> None:
            rows.append(row)
            cells.append(var)
            data.append(value)

        # Runtime rows: Σ cost x + Σ load y − z ≤ −fixed_j.
        for j, w in enumerate(cols):
            for i, (src, q) in enumerate(movable):
                add(j, i * len(cols) + j, request_cost(q, src != w, cfg))
                if src != w:
                    c[i * len(cols) + j] = EPSILON
            for (target, _), var in y_index.items():
                if target == w:
                    add(j, var, cfg.adapter_load_tokens)
            add(j, z, -1.0)
            bounds_ub.append(-fixed[w])
        row = len(cols)
        # Memory rows: incoming adapters and requests fit the free pool.
        for j, w in enumerate(cols):
            for i, (src, q) in enumerate(movable):
                if src != w:
                    add(row, i * len(cols) + j, q.context_tokens)
            for (target, adapter), var in y_index.items():
                if target == w:
                    add(row, var, sizes.get(adapter, by_id[w].adapter_tokens.get(adapter, 0)))
            bounds_ub.append(max(0, by_id[w].free_tokens))
            row += 1
        # A request only where its adapter is: x_rj − y_lj ≤ 0.
        for i, (_, q) in enumerate(movable):
            for j, w in enumerate(cols):
                var = y_index.get((w, q.adapter_id))
                if var is not None:
                    add(row, i * len(cols) + j, 1.0)
                    add(row, var, -1.0)
                    bounds_ub.append(0.0)
                    row += 1
        a_ub = coo_matrix((data, (rows, cells)), shape=(row, z + 1))
        a_eq = coo_matrix(
            (np.ones(n_x), ([i for i in range(len(movable)) for _ in cols], list(range(n_x)))),
            shape=(len(movable), z + 1),
        )
        bounds = [(0.0, 1.0)] * (z) + [(0.0, None)]
        solved = linprog(c, A_ub=a_ub, b_ub=bounds_ub, A_eq=a_eq, b_eq=np.ones(len(movable)),
                         bounds=bounds, method="highs")  # fmt: skip
        if solved.status != 0:
            return []
        x = solved.x[:n_x].reshape(len(movable), len(cols))
        moves = self._round(x, movable, cols, by_id, sizes)
        before, _ = makespan(replicas, [], cfg, sizes)
        after, fits = makespan(replicas, moves, cfg, sizes)
        return moves if fits and after < before - EPSILON else []

    def _round(
        self, x: np.ndarray, movable: list[tuple[str, RequestLoad]], cols: list[str],
        by_id: dict[str, ReplicaLoad], sizes: dict[str, int],
    ) -> list[Migration]:  # fmt: skip
        """Round the LP's flows source -> target to whole requests, then repair (module docstring)."""
        cfg = self.config
        mass: dict[tuple[str, int], float] = {}
        for i, (src, _) in enumerate(movable):
            for j, w in enumerate(cols):
                if w != src:
                    mass[(src, j)] = mass.get((src, j), 0.0) + float(x[i, j])
        chosen: list[tuple[int, int]] = []  # (request index, target column)
        taken: set[int] = set()
        for (src, j), flow in sorted(mass.items(), key=lambda item: (-item[1], item[0])):
            quota = round(flow)
            ranked = sorted((i for i, (s, _) in enumerate(movable) if s == src and i not in taken),
                            key=lambda i: (-float(x[i, j]), i))  # fmt: skip
            for i in ranked[:quota]:
                taken.add(i)
                chosen.append((i, j))
        free = {w: by_id[w].free_tokens for w in cols}
        cost = {w: replica_cost(by_id[w], cfg) for w in cols}
        arriving: set[tuple[str, str]] = set()
        moves = []
        for i, j in chosen:
            src, q = movable[i]
            target = cols[j]
            adapter_new = (
                bool(q.adapter_id)
                and q.adapter_id not in by_id[target].resident_adapters
                and (target, q.adapter_id) not in arriving
            )
            need = q.context_tokens + (sizes.get(q.adapter_id, 0) if adapter_new else 0)
            added = request_cost(q, True, cfg) + (cfg.adapter_load_tokens if adapter_new else 0.0)
            if need > free[target] or cost[target] + added >= cost[src]:
                continue
            free[target] -= need
            cost[src] -= request_cost(q, False, cfg)
            cost[target] += added
            if adapter_new:
                arriving.add((target, q.adapter_id))
            moves.append(Migration(q.request_id, q.adapter_id, src, target))
        return moves
