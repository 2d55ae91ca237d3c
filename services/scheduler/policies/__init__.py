"""Cluster policies of the scheduler, one file per policy behind one small interface.

:data:`PLACEMENT_POLICIES` maps the names accepted by ``--placement`` to their classes.
"""

from __future__ import annotations

from services.scheduler.placement import WaitModel
from services.scheduler.policies.interface import PlacementPolicy
from services.scheduler.policies.least_estimated_wait import LeastEstimatedWait
from services.scheduler.policies.least_loaded import LeastLoaded
from services.scheduler.policies.round_robin import RoundRobin

PLACEMENT_POLICIES: dict[str, type[LeastEstimatedWait | LeastLoaded | RoundRobin]] = {
    cls.name: cls for cls in (LeastEstimatedWait, LeastLoaded, RoundRobin)
}
"""``--placement`` name -> policy class (each takes the shared :class:`WaitModel`)."""


def make_placement(name: str, model: WaitModel | None = None) -> PlacementPolicy:
    """A fresh placement policy by name; ValueError naming the known ones otherwise."""
    try:
        cls = PLACEMENT_POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(PLACEMENT_POLICIES))
        raise ValueError(f"unknown placement policy {name!r}; known: {known}") from None
    return cls(model)
