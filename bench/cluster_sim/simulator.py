"""Discrete-event simulation of a loramesh cluster driving the scheduler's real policy objects.

Events (arrivals, step ends, adapter loads done, load reports, migration and prefetch rounds) sit
in one heap ordered by virtual time; handling one may schedule others. Nothing sleeps and nothing
reads a clock: the same trace, specs and policies always give the same result.

The scheduler side is the real code: a :class:`~services.scheduler.cluster_view.ClusterView`
fed by the workers' load reports every ``report_interval_s`` (so placements see reports as stale
as the real scheduler does, plus its own placements since; with prefix-aware placement, its
prefix index of the prompt blocks it placed), any placement policy from
``services.scheduler.policies``, and optionally a migration and a prefetch policy over a
:class:`~services.scheduler.policies.replica_load.ClusterLoad` built from the workers.
A migrated request moves as its tokens: it leaves its worker (its KV is dropped), joins the
back of the target's queue with prompt + tokens so far to prefill again (as the resume path
submits it; ``migrated_keep_place`` puts it by its arrival time instead), and its adapter is
fetched there unless the target holds it.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from bench.cluster_sim.worker import SimRequest, SimWorker, WorkerSpec
from bench.workload import TraceRequest
from services.gpu_worker.engine.policies.linear_cost import LinearCost
from services.scheduler.cluster_view import ClusterView
from services.scheduler.placement import PlacementRequest
from services.scheduler.policies import uses_prefix_index
from services.scheduler.policies.interface import PlacementPolicy
from services.scheduler.policies.replica_load import (
    ClusterLoad,
    MigrationPolicy,
    PrefetchPolicy,
    ReplicaLoad,
    RequestLoad,
)
from services.scheduler.prefix_index import PrefixIndex, PrefixIndexConfig


@dataclass(frozen=True)
class SimConfig:
    """The simulated cluster."""

    workers: int = 4
    """Number of simulated gpu_workers."""
    worker: WorkerSpec = field(default_factory=WorkerSpec)
    """Capacity of each."""
    report_interval_s: float = 0.5
    """How often workers publish load reports to the scheduler's view."""
    demand_window_s: float = 10.0
    """Window of the per-adapter request rates and per-replica invocations given to policies."""
    migrated_keep_place: bool = False
    """A migrated request joins the target's queue by its arrival time instead of at the back
    (the resume path resubmits it, so today it goes to the back)."""
    prefix_index: PrefixIndexConfig = field(default_factory=PrefixIndexConfig)
    """Bounds of the scheduler's prefix index, kept when the placement policy reads it."""


@dataclass(frozen=True)
class PromptTraceRequest(TraceRequest):
    """A trace request whose prompt is named by its blocks (a prefix-sharing workload)."""

    prefix_blocks: tuple[bytes, ...] = ()
    """Chain hashes of the prompt's whole blocks, as the gateway sends them with a placement."""


@dataclass
class SimResult:
    requests: list[SimRequest]
    migrations: int = 0
    prefetches: int = 0
    preemptions: int = 0
    end_s: float = 0.0
    """Virtual time of the last event (a periodic report may come after the last completion)."""


class ClusterSimulator:
    def __init__(
        self,
        config: SimConfig,
        cost: LinearCost,
        placement: PlacementPolicy,
        migration: MigrationPolicy | None = None,
        prefetch: PrefetchPolicy | None = None,
    ):
        self.config = config
        self.placement = placement
        self.migration = migration
        self.prefetch = prefetch
        self.now = 0.0
        self.workers = {
            f"w{i:03d}": SimWorker(f"w{i:03d}", config.worker, cost) for i in range(config.workers)
        }
        index = (
            PrefixIndex(config.prefix_index, clock=lambda: self.now) if uses_prefix_index(placement) else None
        )
        self.view = ClusterView(clock=lambda: self.now, prefix_index=index)
        self.view.update_members({w: f"sim:{w}" for w in self.workers})
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._pending = 0
        self._recent: deque[tuple[float, str, str]] = deque()
        """(time, adapter, request id) of placements within the demand window."""
        self._ranks: dict[str, int] = {}
        self._by_id: dict[str, SimRequest] = {}
        self.result = SimResult(requests=[])

    # -- the event loop ------------------------------------------------------------------------

    def at(self, time_s: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (time_s, next(self._seq), action))

    def run(self, trace: list[TraceRequest]) -> SimResult:
        for item in trace:
            request = SimRequest(item.request_id, f"a{item.adapter}", item.rank, item.input_len,
                                 item.output_len, item.time_s)  # fmt: skip
            if isinstance(item, PromptTraceRequest):
                request.prefix_blocks = item.prefix_blocks
            self._ranks[request.adapter] = item.rank
            self.result.requests.append(request)
            self._by_id[request.request_id] = request
            self.at(item.time_s, lambda r=request: self._arrive(r))
        self._pending = len(trace)
        self._report()
        if self.migration is not None:
            self.at(self.migration.interval_s(), self._migrate)
        if self.prefetch is not None:
            self.at(self.prefetch.interval_s, self._prefetch)
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()
        self.result.end_s = self.now
        self.result.preemptions = sum(w.preemptions for w in self.workers.values())
        return self.result

    def _periodic(self, interval_s: float, action: Callable[[], None]) -> None:
        """Run ``action`` again after ``interval_s`` while requests remain unfinished."""
        if self._pending:
            self.at(self.now + interval_s, action)

    # -- events --------------------------------------------------------------------------------

    def _arrive(self, request: SimRequest) -> None:
        block = self.config.worker.prefix_block_tokens
        wanted = PlacementRequest(request_id=request.request_id, adapter_id=request.adapter,
                                  prompt_tokens=request.input_len, max_tokens=request.output_len,
                                  prefix_blocks=request.prefix_blocks, prefix_block_tokens=block)  # fmt: skip
        snapshot = self.view.snapshot_for(request.prefix_blocks, block, request.input_len)
        chosen = self.placement.place(snapshot, wanted)
        self.view.record_placement(chosen.worker_id, request.adapter, request.prefix_blocks)
        self._recent.append((self.now, request.adapter, request.request_id))
        self._send(request, self.workers[chosen.worker_id])

    def _send(self, request: SimRequest, worker: SimWorker) -> None:
        ready = worker.enqueue(request, self.now)
        if ready is not None:
            self.at(ready, lambda: self._adapter_ready(worker, request.adapter))
        self._kick(worker)

    def _adapter_ready(self, worker: SimWorker, adapter: str) -> None:
        worker.adapter_ready(adapter, self._ranks.get(adapter, 8))
        self._kick(worker)

    def _kick(self, worker: SimWorker) -> None:
        step = worker.start_step(self.now)
        if step is not None:
            self.at(step.end_s, lambda: self._step_end(worker))

    def _step_end(self, worker: SimWorker) -> None:
        self._pending -= len(worker.finish_step())
        self._kick(worker)

    def _report(self) -> None:
        self.view.update_loads({w.worker_id: w.report(self.now) for w in self.workers.values()})
        self._periodic(self.config.report_interval_s, self._report)

    def _migrate(self) -> None:
        assert self.migration is not None
        for move in self.migration.plan(self.cluster_load()):
            source, target = self.workers[move.source], self.workers[move.target]
            request = source.remove(move.request_id)
            if request is None:
                continue
            request.migrations += 1
            request.keeps_place = self.config.migrated_keep_place
            self.result.migrations += 1
            self._send(request, target)
            self._kick(source)
        self._periodic(self.migration.interval_s(), self._migrate)

    def _prefetch(self) -> None:
        assert self.prefetch is not None
        for order in self.prefetch.plan(self.cluster_load()):
            worker = self.workers[order.target]
            ready = worker.ensure_adapter(order.adapter_id, self._ranks.get(order.adapter_id, 8), self.now)
            if ready is not None:
                self.result.prefetches += 1
                self.at(ready, lambda w=worker, a=order.adapter_id: self._adapter_ready(w, a))
        self._periodic(self.prefetch.interval_s, self._prefetch)

    # -- what migration and prefetch policies see ----------------------------------------------

    def cluster_load(self) -> ClusterLoad:
        window = self.config.demand_window_s
        while self._recent and self._recent[0][0] < self.now - window:
            self._recent.popleft()
        span = max(min(window, self.now), 1e-9)
        rates = Counter(adapter for _, adapter, _ in self._recent)
        # A request counts where it is now: a migrated request's invocation moved with it.
        invocations: dict[str, Counter[str]] = {w: Counter() for w in self.workers}
        for _, adapter, request_id in self._recent:
            invocations[self._by_id[request_id].worker][adapter] += 1
        per_rank = self.config.worker.adapter_tokens_per_rank
        sizes = MappingProxyType({a: r * per_rank for a, r in self._ranks.items()})
        requests = [r for r in self.result.requests if r.finish_s is None and r.worker]
        mean_tokens = (sum(r.reserved_tokens for r in requests) / len(requests)) if requests else 256.0
        replicas = tuple(self._replica(w, invocations[w.worker_id], sizes) for w in self.workers.values())
        return ClusterLoad(
            replicas=replicas,
            now_s=self.now,
            adapter_rates=MappingProxyType({a: n / span for a, n in rates.items()}),
            adapter_sizes=sizes,
            mean_request_tokens=mean_tokens,
        )

    def _replica(self, worker: SimWorker, invocations: Counter[str], sizes: Mapping[str, int]) -> ReplicaLoad:
        def load(r: SimRequest, running: bool) -> RequestLoad:
            return RequestLoad(
                r.request_id, r.adapter, r.output_len - r.generated, r.reserved_tokens, running
            )

        queued = worker.waiting()
        delay = sum(self.now - r.enqueued_s for r in queued) / len(queued) if queued else 0.0
        return ReplicaLoad(
            worker_id=worker.worker_id,
            requests=tuple(load(r, True) for r in worker.running) + tuple(load(r, False) for r in queued),
            resident_adapters=frozenset(worker.holds()),
            memory_tokens=worker.spec.memory_tokens,
            free_tokens=worker.free_tokens(),
            adapter_tokens=sizes,
            invocations=MappingProxyType(dict(invocations)),
            queue_delay_s=delay,
            max_running=worker.spec.max_running,
        )
