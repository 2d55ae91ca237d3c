"""The global debt ledger (DistKV-LLM's gManager, seed 003 §4.4): who has free KV blocks and
who lent how many to whom.

One row per live gpu_worker, ``(id, free blocks)`` with sub-rows ``(debtor id, blocks lent to
it)``, exactly what each worker's heartbeat (its ``WorkerLoad``) says. Consistency is loose on
purpose: the ledger never tracks single allocations; every heartbeat replaces the worker's row,
so the ledger converges within one heartbeat of any change, and a worker whose report or member
key vanishes is dropped with its row.

A creditor that refuses a debtor (it ran short between two heartbeats) is marked *refused*: it
lends nothing in the ledger's eyes until its next heartbeat shows its real state.

No gRPC and no etcd here: the service turns etcd watches into :class:`WorkerBlocks` rows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

log = logging.getLogger("loramesh.kv_manager.ledger")

_NO_DEBTS: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True)
class WorkerBlocks:
    """One ledger row: a worker's KV blocks as of its latest heartbeat."""

    worker_id: str
    """Instance id of the gpu_worker (the last segment of its etcd member key)."""
    address: str = ""
    """gRPC ``host:port`` a debtor negotiates with."""
    free_blocks: int = 0
    """KV blocks free in the worker's pool."""
    total_blocks: int = 0
    """KV blocks the worker's pool holds in all."""
    lent: Mapping[str, int] = field(default_factory=lambda: _NO_DEBTS)
    """debtor id -> blocks this worker holds for that debtor now."""
    topology: str = ""
    """Locality label (node, rack, zone...): creditors sharing the debtor's label come first."""
    lend_cap_blocks: int | None = None
    """Most blocks the worker lends out in all; None: only its free blocks limit it."""
    reported_at: float = 0.0
    """Unix time (s) of the heartbeat this row comes from."""

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("a ledger row needs a worker id")
        negative = {k: v for k, v in self.lent.items() if v < 0}
        if self.free_blocks < 0 or self.total_blocks < 0 or negative:
            raise ValueError(f"negative block counts in the row of {self.worker_id}")
        object.__setattr__(self, "lent", MappingProxyType({k: v for k, v in self.lent.items() if v > 0}))

    @property
    def lent_total(self) -> int:
        """Blocks this worker holds for debtors, all together."""
        return sum(self.lent.values())

    @property
    def lend_ceiling(self) -> int:
        """Most blocks the worker would ever lend: its lending cap, or its whole pool without one
        (at least what it has free and lent now, should a report leave the total out)."""
        pool = max(self.total_blocks, self.free_blocks + self.lent_total)
        return pool if self.lend_cap_blocks is None else min(pool, self.lend_cap_blocks)

    @property
    def lendable_blocks(self) -> int:
        """Blocks the worker could lend now: its free blocks, within its lending cap."""
        if self.lend_cap_blocks is None:
            return self.free_blocks
        return max(0, min(self.free_blocks, self.lend_cap_blocks - self.lent_total))


class DebtLedger:
    """The ledger the gManager keeps. Not thread-safe: use it from one event loop.

    - :meth:`replace` takes the rows of every live worker (one per heartbeat listing);
    - :meth:`mark_refused` records a creditor's refusal until its next heartbeat;
    - :meth:`debts` gives the debt edges between live workers, for DGFM.
    """

    def __init__(self) -> None:
        self._rows: dict[str, WorkerBlocks] = {}
        self._refused_at: dict[str, float] = {}
        self.unreported: frozenset[str] = frozenset()
        """Live workers with no load report yet: what they could lend is unknown."""
        self.version = 0
        """Bumped on every change, so readers can tell whether to sort again."""

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._rows

    def replace(self, rows: Iterable[WorkerBlocks], unreported: Iterable[str] = ()) -> None:
        """The live workers are exactly those of ``rows`` (one row each); others are dropped.
        ``unreported``: live workers with no load report yet (what they could lend is unknown).

        A refusal mark lasts until the worker sends a heartbeat other than the one the mark was
        made under (a different ``reported_at``).
        """
        self.unreported = frozenset(unreported)
        new_rows = {row.worker_id: row for row in rows}
        for worker_id in self._rows.keys() - new_rows.keys():
            log.info("worker %s left the ledger", worker_id)
        for worker_id in new_rows.keys() - self._rows.keys():
            log.info("worker %s joined the ledger", worker_id)
        self._rows = new_rows
        self._refused_at = {
            worker_id: at
            for worker_id, at in self._refused_at.items()
            if worker_id in self._rows and self._rows[worker_id].reported_at == at
        }
        self.version += 1

    def mark_refused(self, creditor_id: str) -> bool:
        """The creditor refused a loan: lend nothing from it until its next heartbeat.

        Returns False when the creditor is not in the ledger (nothing to mark).
        """
        row = self._rows.get(creditor_id)
        if row is None:
            return False
        self._refused_at[creditor_id] = row.reported_at
        self.version += 1
        return True

    def refused(self, worker_id: str) -> bool:
        """The worker refused a loan since its latest heartbeat."""
        return worker_id in self._refused_at

    def row(self, worker_id: str) -> WorkerBlocks | None:
        """The worker's row, or None when it is not live."""
        return self._rows.get(worker_id)

    def rows(self) -> tuple[WorkerBlocks, ...]:
        """Every live worker's row, sorted by worker id."""
        return tuple(self._rows[k] for k in sorted(self._rows))

    def lendable(self, worker_id: str) -> int:
        """Blocks the worker can lend as far as the ledger knows (0: unknown, full or refused)."""
        row = self._rows.get(worker_id)
        if row is None or worker_id in self._refused_at:
            return 0
        return row.lendable_blocks

    def debts(self) -> dict[tuple[str, str], int]:
        """``{(debtor, creditor): blocks}``: the debtor's KV blocks the creditor holds, between
        live workers only (a loan to a vanished debtor is freed by its creditor, not swapped)."""
        edges: dict[tuple[str, str], int] = {}
        for creditor, row in self._rows.items():
            for debtor, blocks in row.lent.items():
                if debtor in self._rows and debtor != creditor:
                    edges[(debtor, creditor)] = blocks
        return edges
