"""DGFM, the debt-graph-based fragmented memory manager (seed 003 §4.5, SEED-SPECS §1).

The debt graph has one node per live worker and an edge ``u -> v`` weighted by the number of
u's KV blocks that v holds (from the ledger). A directed cycle ``u0 -> u1 -> ... -> u0`` can be
cancelled without moving occupancy: with ``m`` the smallest weight on the cycle, each ``u_i``
recalls ``m`` of its own blocks from ``u_{i+1}`` into the ``m`` slots freed by ``u_{i-1}``
recalling its blocks from ``u_i``. Every edge of the cycle drops by ``m``, at least one
disappears, and each worker holds as many blocks as before: locality is restored for free.

Swaps of fewer than ``min_swap_blocks`` blocks are not worth freezing workers for, so only
edges of at least that weight take part. Each round finds a cycle by depth-first search (from a
random start when a ``random.Random`` is given, else in worker-id order, for reproducible
plans) and cancels it; an edge that falls below the threshold leaves the graph. Every round
removes an edge, so planning ends after at most as many rounds as there are edges.

This module only plans: the service hands the plan to the workers, which freeze the blocks
involved and move them. No gRPC here.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

Debts = Mapping[tuple[str, str], int]
"""``{(debtor, creditor): blocks}``: the debtor's KV blocks that the creditor holds."""


@dataclass(frozen=True)
class DgfmConfig:
    """How DGFM plans swaps."""

    min_swap_blocks: int = 4
    """Smallest number of blocks worth one swap (the paper's per-node threshold; SEED-SPECS §1
    uses 4 blocks of 16 tokens). Cycles whose smallest debt is below it are left alone."""

    def __post_init__(self) -> None:
        if self.min_swap_blocks < 1:
            raise ValueError(f"DgfmConfig.min_swap_blocks must be >= 1, got {self.min_swap_blocks}")


@dataclass(frozen=True)
class BlockRecall:
    """One move of a swap: ``owner`` takes ``blocks`` of its own KV blocks back from ``holder``."""

    owner_id: str
    """The debtor whose blocks come home."""
    holder_id: str
    """The creditor that held them (and receives the same number of its predecessor's slots)."""
    blocks: int
    """Blocks moved."""


@dataclass(frozen=True)
class CycleSwap:
    """One cancelled debt cycle: ``cycle[i]`` owed ``cycle[i+1]`` (and the last owed the first)."""

    cycle: tuple[str, ...]
    """Workers on the cycle, in debt order, starting at the smallest worker id."""
    blocks: int
    """The smallest debt on the cycle: what every debt on it shrinks by."""

    @property
    def recalls(self) -> tuple[BlockRecall, ...]:
        """The moves the workers make: each one recalls ``blocks`` from its successor."""
        n = len(self.cycle)
        return tuple(BlockRecall(self.cycle[i], self.cycle[(i + 1) % n], self.blocks) for i in range(n))


@dataclass(frozen=True)
class DefragPlan:
    """What DGFM decided over one ledger snapshot."""

    swaps: tuple[CycleSwap, ...]
    """Cycles to cancel, in the order they were found (apply them in this order)."""
    debts_before: Debts
    """The debt edges the plan was made from (positive, between two different workers)."""
    debts_after: Debts
    """The debt edges once every swap is done (zero edges removed)."""

    @property
    def swap_count(self) -> int:
        """Cycles cancelled."""
        return len(self.swaps)

    @property
    def blocks_moved(self) -> int:
        """Blocks recalled over all swaps."""
        return sum(swap.blocks * len(swap.cycle) for swap in self.swaps)

    @property
    def frozen_workers(self) -> frozenset[str]:
        """Workers whose lent and borrowed blocks must not change while the plan is applied."""
        return frozenset(w for swap in self.swaps for w in swap.cycle)

    @property
    def remote_blocks_before(self) -> int:
        return sum(self.debts_before.values())

    @property
    def remote_blocks_after(self) -> int:
        return sum(self.debts_after.values())


def _find_cycle(graph: Mapping[str, Mapping[str, int]], starts: list[str]) -> list[str] | None:
    """A directed cycle of ``graph`` (``{node: {successor: weight}}``), or None.

    Iterative DFS with three colours; a grey successor closes the cycle on the current path.
    """
    done: set[str] = set()
    for start in starts:
        if start in done:
            continue
        path: list[str] = [start]
        on_path = {start: 0}
        successors = [iter(sorted(graph.get(start, {})))]
        while path:
            nxt = next(successors[-1], None)
            if nxt is None:
                node = path.pop()
                successors.pop()
                del on_path[node]
                done.add(node)
            elif nxt in on_path:
                return path[on_path[nxt] :]
            elif nxt not in done:
                on_path[nxt] = len(path)
                path.append(nxt)
                successors.append(iter(sorted(graph.get(nxt, {}))))
    return None


def _rotate_to_smallest(cycle: list[str]) -> tuple[str, ...]:
    i = cycle.index(min(cycle))
    return tuple(cycle[i:] + cycle[:i])


def plan_defragmentation(
    debts: Debts, config: DgfmConfig | None = None, rng: random.Random | None = None
) -> DefragPlan:
    """Cancel the debt cycles of ``debts`` whose every edge is at least ``min_swap_blocks``."""
    config = config or DgfmConfig()
    before = {edge: blocks for edge, blocks in debts.items() if blocks > 0 and edge[0] != edge[1]}
    remaining = dict(before)
    graph: dict[str, dict[str, int]] = {}
    for (debtor, creditor), blocks in remaining.items():
        if blocks >= config.min_swap_blocks:
            graph.setdefault(debtor, {})[creditor] = blocks
    swaps: list[CycleSwap] = []
    while True:
        starts = sorted(graph)
        if rng is not None:
            rng.shuffle(starts)
        cycle = _find_cycle(graph, starts)
        if cycle is None:
            break
        edges = [(cycle[i], cycle[(i + 1) % len(cycle)]) for i in range(len(cycle))]
        m = min(graph[u][v] for u, v in edges)
        for u, v in edges:
            remaining[(u, v)] -= m
            if remaining[(u, v)] < config.min_swap_blocks:
                del graph[u][v]
            else:
                graph[u][v] = remaining[(u, v)]
        swaps.append(CycleSwap(_rotate_to_smallest(cycle), m))
    return DefragPlan(
        swaps=tuple(swaps),
        debts_before=MappingProxyType(before),
        debts_after=MappingProxyType({edge: n for edge, n in remaining.items() if n > 0}),
    )
