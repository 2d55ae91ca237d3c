"""The one small interface every placement policy implements (DESIGN §7).

A policy is a pure object over an immutable :class:`ClusterSnapshot`: no gRPC, no etcd, no clock,
so the service, the admission wrapper and the cluster simulator in ``bench/cluster_sim`` all call
the same code. A policy may keep its own small state between calls (round-robin's cursor).
"""

from __future__ import annotations

from typing import Protocol

from services.scheduler.cluster_view import ClusterSnapshot
from services.scheduler.placement import PlacementDecision, PlacementRequest


class PlacementPolicy(Protocol):
    """Picks a worker for one request over a snapshot; raises
    :class:`~services.runtime.errors.Unavailable` when the snapshot has no eligible worker."""

    name: str
    """The policy's name in config, flags and bench tables."""

    def place(self, snapshot: ClusterSnapshot, request: PlacementRequest) -> PlacementDecision: ...
