"""dLoRA reactive adapter–request co-migration: a relaxed ILP over the top-K replicas.

dLoRA (seed 001, "Reactive Migration") states the problem in words: place requests and adapters
to minimise the overall runtime across replicas, a request only where its adapter is, within
memory, each request on one replica; solve it only when a replica crosses a memory or queueing
threshold, only over the top-K overloaded and top-K underloaded replicas, with the 0/1 variables
relaxed to [0, 1], each request then going to the column of its largest value (L193).

Runtime model (SEED-SPECS §2 leaves it to us). A continuous-batching replica's step costs
``s(b) = step_base_ms + step_per_request_ms·b`` for a batch of ``b``: a batch of 16 and one of 32
finish their requests at nearly the same rate, so a request costs a replica little while a slot
is free (it rides the batch) and a queued request costs the replica's full-batch throughput,
``rate_j = s(B_j)/B_j`` seconds per token, once the slots are taken. The runtime that migration can
shorten is therefore the replica's *queue wait*: the time to work off the queued tokens its free
slots do not absorb, plus the fetches of the adapters that come with moved requests::

    wait_j = max(0, rate_j·(queued_tokens_j − slots_j·mean_remaining_tokens) + load_s·fetches_j)

where ``slots_j`` is the requests it can start now: ``B_j − running_j``, fewer if its free pool
holds fewer requests of ``slot_memory_tokens``. A queued request moves without recompute; a running one (only
with ``move_running``) adds its context's prefill to the target's wait and leaves its slot at the
source unused by the model (conservative). Over the chosen replicas J and the requests R of the
overloaded ones (the rest's requests stay: ``fixed_j``)::

    min z + δ·Σ_j q_j + ε·Σ_{r, j≠src(r)} x_rj
    q_j ≥ rate_j·(fixed_j + Σ_r tokens_r·x_rj − slots_j·m) + Σ_r pre_rj·x_rj + Σ_{l ∉ res_j} load_s·y_lj
    z ≥ q_j ≥ 0                                                         ∀ j ∈ J
    Σ_j x_rj = 1                                                        ∀ r
    x_rj ≤ y_{l(r)j}                                                    ∀ r, j with l(r) ∉ res_j
    Σ_{l ∉ res_j} size_l·y_lj + Σ_{r running, src(r)≠j} kv_r·x_rj ≤ free_j ∀ j ∈ J
    0 ≤ x, y ≤ 1

``ε`` keeps requests home when moving gains nothing, ``δ`` prefers lower waits on the replicas
that do not set the maximum. The memory rows hold what lands in the target's pool at once (the
adapters, a running request's KV); a moved queued request waits for its slot and its memory in
the target's queue like every other, which the slots term prices.

Rounding. dLoRA sends each request to the column of its largest value. With the adapter
variables relaxed the LP likes to split requests almost evenly (so that y pays half a fetch) and
the argmax then moves nothing; so we round the LP's *flows* instead: ``round(Σ_r x_rj)`` requests
go from each source to each target, those with the largest ``x_rj`` (for an integral solution this
is exactly the argmax). A repair pass then keeps a move only if the target still has the memory
for it (and its adapter) and is left with a shorter wait than its source; the plan is dropped
unless it lowers the model's largest wait below that of no migration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from services.scheduler.policies.replica_load import ClusterLoad, Migration, ReplicaLoad, RequestLoad

EPSILON = 1e-3
"""Weight of the stay-home tie-break, per moved request (seconds)."""
DELTA = 1e-2
"""Weight of the sum of waits beside their maximum."""


@dataclass(frozen=True)
class CoMigrationConfig:
    """Knobs of co-migration ([our choice]: the seed gives no values). The step-time figures
    come from the worker's calibration (``bench/cluster_sim/calibrate.py``)."""

    interval_s: float = 1.0
    """Seconds between checks of the triggers."""
    top_k: int = 2
    """Overloaded and underloaded replicas considered (K of each)."""
    queue_delay_trigger_s: float = 1.0
    """Compute threshold: a replica whose queued requests have waited this long on average."""
    free_memory_trigger: float = 0.0
    """Memory threshold: a replica with less than this share of its pool free (0: off; a
    continuous-batching pool fills with KV by design, so a full pool alone says little)."""
    step_base_ms: float = 220.0
    """Fixed cost of one engine step."""
    step_per_request_ms: float = 26.0
    """What each request in the batch adds to a step (its token, its adapter's share)."""
    prefill_token_ms: float = 8.0
    """What each prefilled context token adds to a step (a moved running request's recompute)."""
    adapter_load_s: float = 0.65
    """Time to fetch an adapter a replica does not hold."""
    max_running: int = 32
    """Batch size of a replica that does not report its own."""
    mean_remaining_tokens: float = 128.0
    """Tokens a free slot is taken for, on average (the workload's mean output)."""
    slot_memory_tokens: float = 256.0
    """Pool a started request comes to occupy, on average (the workload's prompt + output)."""
    move_running: bool = False
    """Also move running requests (their KV is recomputed at the target)."""
    max_requests: int = 256
    """Requests of the overloaded replicas given to the LP at most (the largest)."""

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.max_requests < 1 or self.max_running < 1:
            raise ValueError(
                f"top_k, max_requests and max_running must be >= 1, got {self.top_k}, "
                f"{self.max_requests}, {self.max_running}"
            )
        for name in ("interval_s", "queue_delay_trigger_s", "free_memory_trigger", "step_base_ms",
                     "step_per_request_ms", "prefill_token_ms", "adapter_load_s",
                     "mean_remaining_tokens", "slot_memory_tokens"):  # fmt: skip
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")


def batch_size(replica: ReplicaLoad, config: CoMigrationConfig) -> int:
    return replica.max_running or config.max_running


def seconds_per_token(replica: ReplicaLoad, config: CoMigrationConfig) -> float:
    """``rate_j``: a full batch's step time over its size."""
    b = batch_size(replica, config)
    return (config.step_base_ms + config.step_per_request_ms * b) / b / 1000.0


def slack_s(replica: ReplicaLoad, config: CoMigrationConfig) -> float:
    """The queued work its free slots absorb, in seconds of full-batch throughput."""
    free_slots = batch_size(replica, config) - sum(1 for q in replica.requests if q.running)
    slots = max(0, min(free_slots, int(replica.free_tokens // max(1.0, config.slot_memory_tokens))))
    return seconds_per_token(replica, config) * slots * config.mean_remaining_tokens


def request_cost(request: RequestLoad, moved: bool, replica: ReplicaLoad, config: CoMigrationConfig) -> float:
    """Seconds ``request`` adds to ``replica``'s queued work (before the slack): its tokens if it
    queues there, its recompute if it is a running request moved there, nothing if it runs there."""
    if request.running and not moved:
        return 0.0
    cost = seconds_per_token(replica, config) * request.remaining_tokens
    if request.running:
        cost += config.prefill_token_ms * request.context_tokens / 1000.0
    return cost


def replica_cost(replica: ReplicaLoad, config: CoMigrationConfig) -> float:
    """The model's queue wait of a replica with no migration."""
    work = sum(request_cost(r, False, replica, config) for r in replica.requests)
    return max(0.0, work - slack_s(replica, config))


def makespan(
    replicas: tuple[ReplicaLoad, ...] | list[ReplicaLoad], moves: list[Migration], config: CoMigrationConfig,
    adapter_sizes: dict[str, int] | None = None,
) -> tuple[float, bool]:  # fmt: skip
    """The model's objective after ``moves``: the largest wait over ``replicas``, and whether
    every replica's incoming requests and adapters fit its free memory."""
    by_id = {r.worker_id: r for r in replicas}
    work = {w: sum(request_cost(q, False, r, config) for q in r.requests) for w, r in by_id.items()}
    fetch = dict.fromkeys(by_id, 0.0)
    incoming = dict.fromkeys(by_id, 0)
    loaded: set[tuple[str, str]] = set()
    requests = {(m.source, q.request_id): q for m in moves for q in by_id[m.source].requests}
    for move in moves:
        request = requests[(move.source, move.request_id)]
        work[move.source] -= request_cost(request, False, by_id[move.source], config)
        work[move.target] += request_cost(request, True, by_id[move.target], config)
        incoming[move.target] += request.context_tokens if request.running else 0
        key = (move.target, request.adapter_id)
        if (
            request.adapter_id
            and request.adapter_id not in by_id[move.target].resident_adapters
            and key not in loaded
        ):
            loaded.add(key)
            fetch[move.target] += config.adapter_load_s
            sizes = adapter_sizes or by_id[move.target].adapter_tokens
            incoming[move.target] += sizes.get(request.adapter_id, 0)
    waits = [max(0.0, work[w] - slack_s(r, config) + fetch[w]) for w, r in by_id.items()]
    fits = all(incoming[w] <= by_id[w].free_tokens for w in by_id)
    return max(waits, default=0.0), fits


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
        """Top-K overloaded (the longest waits) and top-K underloaded (the shortest waits, then
        the most free slots) replicas."""
        cfg = self.config
        cost = {r.worker_id: replica_cost(r, cfg) for r in cluster.replicas}
        slack = {r.worker_id: slack_s(r, cfg) for r in cluster.replicas}
        over = sorted((r for r in cluster.replicas if cost[r.worker_id] > 0),
                      key=lambda r: (-cost[r.worker_id], r.worker_id))[: cfg.top_k]  # fmt: skip
        taken = {r.worker_id for r in over}
        under = sorted((r for r in cluster.replicas if r.worker_id not in taken),
                       key=lambda r: (cost[r.worker_id], -slack[r.worker_id], r.worker_id))[: cfg.top_k]  # fmt: skip
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
        movable = self._movable(sources)
        if not movable:
            return []
        lp = _Variables(movable, replicas)
        a_ub, b_ub = _constraints(lp, sizes, cfg)
        a_eq = coo_matrix(
            (np.ones(lp.n_x), ([i for i in range(len(movable)) for _ in lp.cols], list(range(lp.n_x)))),
            shape=(len(movable), lp.z + 1),
        )
        bounds = [(0.0, 1.0)] * (lp.n_x + len(lp.y_index)) + [(0.0, None)] * (len(lp.cols) + 1)
        solved = linprog(_objective(lp), A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=np.ones(len(movable)),
                         bounds=bounds, method="highs")  # fmt: skip
        if solved.status != 0:
            return []
        x = solved.x[: lp.n_x].reshape(len(movable), len(lp.cols))
        moves = self._round(x, movable, lp.cols, lp.by_id, sizes)
        before, _ = makespan(replicas, [], cfg, sizes)
        after, fits = makespan(replicas, moves, cfg, sizes)
        return moves if fits and after < before - EPSILON else []

    def _movable(self, sources: list[ReplicaLoad]) -> list[tuple[str, RequestLoad]]:
        """The requests the LP may move, (source, request), the largest first, at most
        ``max_requests``."""
        cfg = self.config
        return sorted(
            (
                (src.worker_id, q)
                for src in sources
                for q in src.requests
                if cfg.move_running or not q.running
            ),
            key=lambda item: (-item[1].remaining_tokens, item[0], item[1].request_id),
        )[: cfg.max_requests]

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
        work = {w: sum(request_cost(q, False, by_id[w], cfg) for q in by_id[w].requests) for w in cols}
        fetch = dict.fromkeys(cols, 0.0)

        def wait(w: str) -> float:
            return max(0.0, work[w] - slack_s(by_id[w], cfg) + fetch[w])

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
            need = (q.context_tokens if q.running else 0) + (sizes.get(q.adapter_id, 0) if adapter_new else 0)
            added = request_cost(q, True, by_id[target], cfg)
            load = cfg.adapter_load_s if adapter_new else 0.0
            if need > free[target]:
                continue
            if max(0.0, work[target] + added - slack_s(by_id[target], cfg) + fetch[target] + load) >= wait(
                src
            ):
                continue
            free[target] -= need
            work[src] -= request_cost(q, False, by_id[src], cfg)
            work[target] += added
            fetch[target] += load
            if adapter_new:
                arriving.add((target, q.adapter_id))
            moves.append(Migration(q.request_id, q.adapter_id, src, target))
        return moves


class _Variables:
    """The LP's variables, in this order: ``x_rj`` (movable request ``i`` to column ``j``), then
    ``y_lj`` (an adapter that column ``j`` does not hold, fetched there), then ``q_j``, then ``z``."""

    def __init__(self, movable: list[tuple[str, RequestLoad]], replicas: list[ReplicaLoad]):
        self.movable = movable
        self.cols = [r.worker_id for r in replicas]
        self.by_id = {r.worker_id: r for r in replicas}
        self.n_x = len(movable) * len(self.cols)
        needs = sorted({(w, q.adapter_id) for _, q in movable for w in self.cols
                        if q.adapter_id and q.adapter_id not in self.by_id[w].resident_adapters})  # fmt: skip
        self.y_index = {key: self.n_x + i for i, key in enumerate(needs)}
        self.q_var = {w: self.n_x + len(needs) + j for j, w in enumerate(self.cols)}
        self.z = self.n_x + len(needs) + len(self.cols)

    def x(self, i: int, j: int) -> int:
        return i * len(self.cols) + j


class _Rows:
    """The inequality rows ``A_ub·v ≤ b_ub``, built one row at a time."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cells: list[int] = []
        self.data: list[float] = []
        self.bounds: list[float] = []

    def add(self, var: int, value: float) -> None:
        """A coefficient of the row being built."""
        self.rows.append(len(self.bounds))
        self.cells.append(var)
        self.data.append(value)

    def close(self, bound: float) -> None:
        """Ends the row being built with its upper bound."""
        self.bounds.append(bound)


def _objective(lp: _Variables) -> np.ndarray:
    """``z + δ·Σ_j q_j + ε·Σ_{r, j≠src(r)} x_rj``."""
    c = np.zeros(lp.z + 1)
    c[lp.z] = 1.0
    for var in lp.q_var.values():
        c[var] = DELTA
    for i, (src, _) in enumerate(lp.movable):
        for j, w in enumerate(lp.cols):
            if src != w:
                c[lp.x(i, j)] = EPSILON
    return c


def _constraints(
    lp: _Variables, sizes: dict[str, int], cfg: CoMigrationConfig
) -> tuple[coo_matrix, list[float]]:
    """``A_ub`` and ``b_ub``: the wait rows, the memory rows, then a request only where its adapter is."""
    by_id = lp.by_id
    fixed = {w: sum(request_cost(q, False, by_id[w], cfg) for q in by_id[w].requests) for w in lp.cols}
    for w, q in lp.movable:
        fixed[w] -= request_cost(q, False, by_id[w], cfg)
    rows = _Rows()
    # Wait rows: Σ cost x + Σ load y − q_j ≤ slack_j − fixed_j, and q_j − z ≤ 0.
    for j, w in enumerate(lp.cols):
        for i, (src, q) in enumerate(lp.movable):
            rows.add(lp.x(i, j), request_cost(q, src != w, by_id[w], cfg))
        for (target, _), var in lp.y_index.items():
            if target == w:
                rows.add(var, cfg.adapter_load_s)
        rows.add(lp.q_var[w], -1.0)
        rows.close(slack_s(by_id[w], cfg) - fixed[w])
        rows.add(lp.q_var[w], 1.0)
        rows.add(lp.z, -1.0)
        rows.close(0.0)
    # Memory rows: incoming adapters and running requests' KV fit the free pool.
    for j, w in enumerate(lp.cols):
        for i, (src, q) in enumerate(lp.movable):
            if src != w and q.running:
                rows.add(lp.x(i, j), q.context_tokens)
        for (target, adapter), var in lp.y_index.items():
            if target == w:
                rows.add(var, sizes.get(adapter, by_id[w].adapter_tokens.get(adapter, 0)))
        rows.close(max(0, by_id[w].free_tokens))
    # A request only where its adapter is: x_rj − y_lj ≤ 0.
    for i, (_, q) in enumerate(lp.movable):
        for j, w in enumerate(lp.cols):
            var = lp.y_index.get((w, q.adapter_id))
            if var is not None:
                rows.add(lp.x(i, j), 1.0)
                rows.add(var, -1.0)
                rows.close(0.0)
    a_ub = coo_matrix((rows.data, (rows.rows, rows.cells)), shape=(len(rows.bounds), lp.z + 1))
    return a_ub, rows.bounds
