"""Cluster policies of the scheduler, one file per policy behind one small interface.

:data:`PLACEMENT_POLICIES` maps the names accepted by ``--placement`` to their classes;
:func:`make_migration` and :func:`make_prefetch` build the ``--migration`` and ``--prefetch``
policies (each with its default knobs; "none" is no policy).
"""

from __future__ import annotations

from collections.abc import Callable

from services.scheduler.placement import WaitModel
from services.scheduler.policies.batch_balancing import BatchBalancing
from services.scheduler.policies.burst_tolerance_prefetch import BurstTolerancePrefetch
from services.scheduler.policies.interface import PlacementPolicy
from services.scheduler.policies.least_estimated_wait import LeastEstimatedWait
from services.scheduler.policies.least_loaded import LeastLoaded
from services.scheduler.policies.pets_balancing import PetsBalancing
from services.scheduler.policies.prefix_aware import PrefixAware, PrefixAwareConfig
from services.scheduler.policies.replica_load import MigrationPolicy, PrefetchPolicy
from services.scheduler.policies.round_robin import RoundRobin

PLACEMENT_POLICIES: dict[str, type[LeastEstimatedWait | LeastLoaded | PrefixAware | RoundRobin]] = {
    cls.name: cls for cls in (LeastEstimatedWait, LeastLoaded, PrefixAware, RoundRobin)
}
"""``--placement`` name -> policy class (each takes the shared :class:`WaitModel`)."""


def make_placement(
    name: str, model: WaitModel | None = None, prefix: PrefixAwareConfig | None = None
) -> PlacementPolicy:
    """A fresh placement policy by name (``prefix``: prefix-aware's weights, default ones when
    None); ValueError naming the known ones otherwise."""
    try:
        cls = PLACEMENT_POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(PLACEMENT_POLICIES))
        raise ValueError(f"unknown placement policy {name!r}; known: {known}") from None
    return PrefixAware(model, prefix) if cls is PrefixAware else cls(model)


def uses_prefix_index(policy: PlacementPolicy) -> bool:
    """The policy reads the snapshot's prefix hits: the scheduler keeps a prefix index for it."""
    return isinstance(policy, PrefixAware)


def _co_migration() -> MigrationPolicy:
    # Imported when chosen: its LP solver (scipy) would add seconds to every scheduler start,
    # and a restarted replica should be back quickly (docs/operations.md).
    from services.scheduler.policies.co_migration import CoMigration

    return CoMigration()


MIGRATION_POLICIES: dict[str, Callable[[], MigrationPolicy]] = {
    "co-migration": _co_migration,
    PetsBalancing.name: PetsBalancing,
    BatchBalancing.name: BatchBalancing,
}
"""``--migration`` name -> a function (or class) making the policy with its default knobs."""

PREFETCH_POLICIES: dict[str, type[BurstTolerancePrefetch]] = {
    BurstTolerancePrefetch.name: BurstTolerancePrefetch
}
"""``--prefetch`` name -> policy class."""


def make_migration(name: str) -> MigrationPolicy | None:
    """A migration policy by name with its default knobs; None for "none"."""
    return None if name == "none" else _lookup(MIGRATION_POLICIES, name, "migration")()


def make_prefetch(name: str) -> PrefetchPolicy | None:
    """A prefetch policy by name with its default knobs; None for "none"."""
    return None if name == "none" else _lookup(PREFETCH_POLICIES, name, "prefetch")()


def _lookup(registry: dict, name: str, kind: str):
    try:
        return registry[name]
    except KeyError:
        known = ", ".join(["none", *sorted(registry)])
        raise ValueError(f"unknown {kind} policy {name!r}; known: {known}") from None
