"""The leader's DGFM runs: plan over the ledger, have the workers apply the plan, count.

Runs never overlap (a lock), whether on demand (``Defragment``) or periodic. The ledger is
loose: after a run, the rows of the workers it moved blocks between say what they said before
until their next heartbeats, so a periodic run waits for those (:meth:`Defragmenter.settled`)
rather than swap the same cycle twice. Workers are reached through a ``connect`` factory (gRPC
in the service), so this module holds no gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from services.kv_manager.dgfm import DgfmConfig, plan_defragmentation
from services.kv_manager.dgfm_execution import DefragOutcome, RecallWorkers, apply_plan
from services.kv_manager.ledger import DebtLedger

log = logging.getLogger("loramesh.kv_manager.dgfm")


class ClosableRecallWorkers(RecallWorkers, Protocol):
    async def close(self) -> None: ...


class Defragmenter:
    """Applies DGFM plans for one kv_manager; ``connect({id: address})`` reaches the workers."""

    def __init__(
        self,
        config: DgfmConfig,
        connect: Callable[[Mapping[str, str]], ClosableRecallWorkers],
        clock: Callable[[], float] = time.time,
    ):
        self.config = config
        self.connect = connect
        self.clock = clock
        self.swaps_total = 0
        """Swaps the workers applied whole."""
        self.blocks_moved_total = 0
        """Blocks they brought home (a failed swap's included)."""
        self.runs_failed = 0
        """Runs stopped by a worker's error."""
        self._lock = asyncio.Lock()
        self._moved: frozenset[str] = frozenset()
        self._ended_at = float("-inf")

    def settled(self, ledger: DebtLedger) -> bool:
        """Every worker the last run moved blocks of has sent a heartbeat since (or left)."""
        return all(
            row.reported_at > self._ended_at for w in self._moved if (row := ledger.row(w)) is not None
        )

    async def run(self, ledger: DebtLedger, config: DgfmConfig | None = None) -> DefragOutcome:
        """Plan over ``ledger`` now and apply the plan."""
        async with self._lock:
            plan = plan_defragmentation(ledger.debts(), config or self.config)
            rows = ledger.rows()
            workers = self.connect({row.worker_id: row.address for row in rows})
            try:
                outcome = await apply_plan(plan, {row.worker_id: row.free_blocks for row in rows}, workers)
            finally:
                await workers.close()
            self.swaps_total += outcome.swaps_done
            self.blocks_moved_total += outcome.blocks_moved
            if outcome.failure is not None:
                self.runs_failed += 1
            if outcome.swaps:
                self._moved = frozenset(w for s in outcome.swaps for w in s.swap.cycle)
                self._ended_at = self.clock()
                log.info(
                    "DGFM: %d of %d swap(s) done, %d blocks home, remote blocks %d -> %d planned",
                    outcome.swaps_done, plan.swap_count, outcome.blocks_moved,
                    plan.remote_blocks_before, plan.remote_blocks_after,
                )  # fmt: skip
            return outcome

    async def run_periodically(
        self, ledger: DebtLedger, interval_s: float, is_leader: Callable[[], bool]
    ) -> None:
        """Every ``interval_s``, while this replica leads and the ledger has settled, run once."""
        while True:
            await asyncio.sleep(interval_s)
            if is_leader() and self.settled(ledger):
                try:
                    await self.run(ledger)
                except Exception:  # a bug in one run must not end the periodic runs
                    log.exception("DGFM run failed")
