"""What the migration and prefetch policies decide on, and what they decide.

Load reports carry counts; migration needs each replica's requests (dLoRA moves requests by
their tokens) and per-adapter demand (burst tolerance, PetS invocations). :class:`ReplicaLoad`
is that richer, still immutable, view of one replica; the bench simulator builds it from its
workers, the service would build it from the workers' request lists. Memory is in KV-token
units everywhere: an adapter occupies ``adapter_tokens`` of the unified pool (S-LoRA), a request
its context.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

_EMPTY: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True)
class RequestLoad:
    """One request on a replica, queued or running."""

    request_id: str
    adapter_id: str
    """Its adapter ("" for the base model)."""
    remaining_tokens: int
    """Tokens it still has to generate."""
    context_tokens: int
    """Tokens of KV it holds (running) or will hold once prefilled (queued): what a move
    recomputes at the target and what it occupies there."""
    running: bool = False
    """In the running batch (a move discards its KV and recomputes it) or still queued."""


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica (worker) as the migration policies see it."""

    worker_id: str
    requests: tuple[RequestLoad, ...] = ()
    resident_adapters: frozenset[str] = frozenset()
    """Adapters the replica holds (in its pool or its host cache) or is fetching: a request for
    one of them needs no new fetch there."""
    memory_tokens: int = 0
    """Capacity of the unified pool, in KV tokens."""
    free_tokens: int = 0
    """Unallocated pool, in KV tokens."""
    adapter_tokens: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """Pool footprint of each adapter it holds or might receive, in KV tokens."""
    invocations: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """adapter -> requests the replica received in the policy's window (PetS's task load)."""
    queue_delay_s: float = 0.0
    """Mean time its queued requests have waited so far (dLoRA's compute trigger)."""
    max_running: int = 0
    """Requests it runs together at most (its ``--max-running``; 0: unknown, the policy's own
    default applies)."""


@dataclass(frozen=True)
class Migration:
    """Move one request (as its tokens: the target recomputes its KV) and its adapter."""

    request_id: str
    adapter_id: str
    source: str
    target: str


@dataclass(frozen=True)
class Prefetch:
    """Load ``adapter_id`` into ``target``'s pool before requests for it arrive there."""

    adapter_id: str
    target: str


@dataclass(frozen=True)
class ClusterLoad:
    """Every replica plus the cluster-wide demand, at one instant (virtual or wall time)."""

    replicas: tuple[ReplicaLoad, ...]
    now_s: float = 0.0
    adapter_rates: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """adapter -> requests per second over the recent window (all replicas)."""
    adapter_sizes: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """adapter -> pool footprint in KV tokens."""
    mean_request_tokens: float = 256.0
    """Mean context a request occupies (prompt + output), to turn free memory into requests."""


class MigrationPolicy(Protocol):
    """Decides request (and adapter) moves between replicas; called every :meth:`interval_s`."""

    name: str

    def interval_s(self) -> float:
        """Seconds until the policy wants to run again (it may adapt it)."""
        ...

    def plan(self, cluster: ClusterLoad) -> list[Migration]: ...


class PrefetchPolicy(Protocol):
    """Decides which adapters to load where ahead of demand; called every ``interval_s``."""

    name: str
    interval_s: float

    def plan(self, cluster: ClusterLoad) -> list[Prefetch]: ...
