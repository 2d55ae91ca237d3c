"""The live mesh's migration and prefetch (issue 16): the policies' plans, executed on workers.

Every round, :class:`Rebalancer` asks each live worker for its requests (``Worker/ListRequests``),
builds the :class:`~services.scheduler.policies.replica_load.ClusterLoad` the policies decide on
(the same type ``bench/cluster_sim`` builds from its simulated workers), and carries out what they
plan:

- a prefetch loads the adapter on the target (``Worker/LoadAdapter``);
- a migration first loads the request's adapter on the target (the adapter moves with the
  request, dLoRA's co-migration), then has the source hand the request off
  (``Worker/HandOff``): its stream ends with ``FINISH_REASON_MIGRATED`` naming the target, and
  its gateway resumes it there as prompt + tokens so far, through the scheduler's ``Place`` with
  ``prefer_worker``. Greedy output is unchanged (tests/e2e/test_migration.py).

A failed step is counted and logged, never fatal: a request whose hand-off fails stays where it
is, and an adapter loaded for nothing is evicted by LRU like any idle one.

No gRPC here: workers are reached through :class:`WorkerControl`, which the service implements
over gRPC (``worker_control.py``) and the unit tests over plain objects.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from services.runtime.errors import FailedPrecondition, NotFound
from services.runtime.field_copy import dataclass_of
from services.scheduler.cluster_view import ClusterSnapshot
from services.scheduler.policies.replica_load import (
    ClusterLoad,
    Migration,
    MigrationPolicy,
    Prefetch,
    PrefetchPolicy,
    ReplicaLoad,
    RequestLoad,
)

log = logging.getLogger("loramesh.scheduler.rebalancing")


@dataclass(frozen=True)
class WorkerRequests:
    """What one worker reports of its requests and pool (``Worker/ListRequests``)."""

    requests: tuple[RequestLoad, ...] = ()
    waited_s: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """request id -> seconds since it arrived on the worker."""
    memory_tokens: int = 0
    free_tokens: int = 0
    max_running: int = 0
    held_adapters: frozenset[str] = frozenset()
    """Adapters with a host copy on the worker: a request for one needs no fetch there."""
    adapter_tokens: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))


class WorkerControl(Protocol):
    """The worker calls rebalancing makes; each raises a domain error when the call fails."""

    async def list_requests(self, address: str) -> WorkerRequests: ...

    async def load_adapter(self, address: str, adapter_id: str) -> None: ...

    async def hand_off(self, address: str, request_id: str, target_worker_id: str) -> int:
        """Tokens the request had generated on the source."""
        ...


class DemandWindow:
    """Requests placed per adapter and per worker over the last ``window_s`` seconds: the
    adapters' rates (burst tolerance) and the replicas' invocations (PetS)."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._clock = clock
        self._started = clock()
        self._placed: deque[tuple[float, str, str]] = deque()

    def record(self, worker_id: str, adapter_id: str) -> None:
        if adapter_id:
            self._placed.append((self._clock(), worker_id, adapter_id))

    def _recent(self) -> list[tuple[float, str, str]]:
        now = self._clock()
        while self._placed and self._placed[0][0] < now - self.window_s:
            self._placed.popleft()
        return list(self._placed)

    def rates(self) -> dict[str, float]:
        """adapter -> requests per second over the window (or since start, if shorter)."""
        span = max(min(self.window_s, self._clock() - self._started), 1e-3)
        return {adapter: n / span for adapter, n in Counter(a for _, _, a in self._recent()).items()}

    def invocations(self) -> dict[str, Counter[str]]:
        """worker -> adapter -> requests placed there over the window."""
        counts: dict[str, Counter[str]] = {}
        for _, worker_id, adapter in self._recent():
            counts.setdefault(worker_id, Counter())[adapter] += 1
        return counts


@dataclass
class RebalanceActivity:
    """What rebalancing has done since start (``ClusterView``, metrics)."""

    rounds: int = 0
    migrations: int = 0
    migration_failures: int = 0
    prefetches: int = 0
    prefetch_failures: int = 0


def replica_load(worker_id: str, listed: WorkerRequests, invocations: Mapping[str, int]) -> ReplicaLoad:
    """One worker as the policies see it."""
    queued = [listed.waited_s.get(q.request_id, 0.0) for q in listed.requests if not q.running]
    return dataclass_of(
        ReplicaLoad,
        listed,
        worker_id=worker_id,
        resident_adapters=listed.held_adapters,
        invocations=MappingProxyType(dict(invocations)),
        queue_delay_s=sum(queued) / len(queued) if queued else 0.0,
    )


def cluster_load(listed: Mapping[str, WorkerRequests], demand: DemandWindow, now_s: float) -> ClusterLoad:
    """The cluster as the migration and prefetch policies see it."""
    invocations = demand.invocations()
    sizes: dict[str, int] = {}
    for worker in listed.values():
        sizes.update(worker.adapter_tokens)
    contexts = [q.context_tokens + q.remaining_tokens for w in listed.values() for q in w.requests]
    return ClusterLoad(
        replicas=tuple(
            replica_load(worker_id, worker, invocations.get(worker_id, {}))
            for worker_id, worker in sorted(listed.items())
        ),
        now_s=now_s,
        adapter_rates=MappingProxyType(demand.rates()),
        adapter_sizes=MappingProxyType(sizes),
        mean_request_tokens=sum(contexts) / len(contexts) if contexts else 256.0,
    )


def owns(worker_request_id: str, request_id: str) -> bool:
    """The worker's request id is ``request_id`` itself or one of its placements (``<id>.<n>``)."""
    if worker_request_id == request_id:
        return True
    head, dot, tail = worker_request_id.rpartition(".")
    return bool(dot) and head == request_id and tail.isdigit()


class Rebalancer:
    """Runs the configured migration and prefetch policies on the live workers."""

    def __init__(
        self,
        control: WorkerControl,
        migration: MigrationPolicy | None = None,
        prefetch: PrefetchPolicy | None = None,
        demand: DemandWindow | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.control = control
        self.migration = migration
        self.prefetch = prefetch
        self.demand = demand or DemandWindow(clock=clock)
        self.activity = RebalanceActivity()
        self._clock = clock

    async def list_workers(self, snapshot: ClusterSnapshot) -> dict[str, WorkerRequests]:
        """Every live worker's requests; a worker that does not answer is left out this round."""
        workers = list(snapshot.workers)
        answers = await asyncio.gather(
            *(self.control.list_requests(w.address) for w in workers), return_exceptions=True
        )
        listed = {}
        for worker, answer in zip(workers, answers):
            if isinstance(answer, BaseException):
                log.info("worker %s did not list its requests: %s", worker.worker_id, answer)
                continue
            listed[worker.worker_id] = answer
        return listed

    async def _round(self, snapshot: ClusterSnapshot) -> ClusterLoad:
        """The cluster a round's policy decides on, counting the round."""
        self.activity.rounds += 1
        return cluster_load(await self.list_workers(snapshot), self.demand, self._clock())

    async def migration_round(self, snapshot: ClusterSnapshot) -> list[Migration]:
        """Plan with the migration policy and execute the plan; returns the moves that happened."""
        if self.migration is None:
            return []
        # Off the event loop: co-migration solves an LP, and Place must not wait for it.
        plan = await asyncio.to_thread(self.migration.plan, await self._round(snapshot))
        done = []
        for move in plan:
            if await self._execute(snapshot, move):
                done.append(move)
        return done

    async def prefetch_round(self, snapshot: ClusterSnapshot) -> list[Prefetch]:
        """Plan with the prefetch policy and load the adapters; returns the loads that happened."""
        if self.prefetch is None:
            return []
        done = []
        for order in await asyncio.to_thread(self.prefetch.plan, await self._round(snapshot)):
            target = snapshot.worker(order.target)
            try:
                if target is None:
                    raise NotFound(f"worker {order.target} left")
                await self.control.load_adapter(target.address, order.adapter_id)
            except Exception as error:  # noqa: BLE001 - counted; the next round plans again
                self.activity.prefetch_failures += 1
                log.info("prefetch of %s to %s failed: %s", order.adapter_id, order.target, error)
                continue
            self.activity.prefetches += 1
            done.append(order)
        return done

    async def migrate(
        self, snapshot: ClusterSnapshot, request_id: str, target_id: str, choose_target
    ) -> tuple[Migration, int]:
        """Move one request now (``Scheduler/Migrate``). ``request_id``: the gateway's id or a
        worker's; ``choose_target(adapter_id, source)``: the target when ``target_id`` is empty.
        Returns the move and the tokens generated before it."""
        listed = await self.list_workers(snapshot)
        found = [
            (worker_id, q)
            for worker_id, worker in sorted(listed.items())
            for q in worker.requests
            if owns(q.request_id, request_id)
        ]
        if not found:
            raise NotFound(f"no live worker has request {request_id!r} queued or running")
        source, request = found[0]
        target = target_id or choose_target(request.adapter_id, source)
        if target == source:
            raise FailedPrecondition(f"request {request_id!r} is already on {source}")
        if snapshot.worker(target) is None:
            raise NotFound(f"worker {target!r} is not live")
        move = Migration(request.request_id, request.adapter_id, source, target)
        generated = await self._hand_off(snapshot, move)
        self.activity.migrations += 1
        return move, generated

    async def _execute(self, snapshot: ClusterSnapshot, move: Migration) -> bool:
        try:
            await self._hand_off(snapshot, move)
        except Exception as error:  # noqa: BLE001 - counted; the request stays where it is
            self.activity.migration_failures += 1
            log.info(
                "migration of %s from %s to %s failed: %s", move.request_id, move.source, move.target, error
            )
            return False
        self.activity.migrations += 1
        log.info(
            "migrated %s (adapter %r) from %s to %s",
            move.request_id,
            move.adapter_id,
            move.source,
            move.target,
        )
        return True

    async def _hand_off(self, snapshot: ClusterSnapshot, move: Migration) -> int:
        source, target = snapshot.worker(move.source), snapshot.worker(move.target)
        if source is None or target is None:
            raise NotFound(f"worker {move.source if source is None else move.target} left")
        if move.adapter_id:
            await self.control.load_adapter(target.address, move.adapter_id)
        return await self.control.hand_off(source.address, move.request_id, move.target)
