"""DGFM on the worker (DistKV-LLM §4.5): bring this worker's own KV blocks home from a creditor.

The kv_manager cancels a debt cycle ``u0 -> u1 -> ... -> u0`` by having each worker recall
``m`` of its blocks from its successor. Each recall runs on the engine thread between two steps,
so the blocks involved cannot change while they move (the freeze). Two forms:

- :meth:`BlockRecalls.recall`: allocate ``m`` local blocks, copy the KV bit for bit from the
  holder, point the block tables at the copies, free the originals at the holder. All or none.
- staging, for a cycle on which no pool has ``m`` free blocks: :meth:`stage_out` reads the
  blocks into host memory and frees them at the holder (making room for the holder's own
  recall), and :meth:`stage_in` writes them back into this pool once the cycle's last recall
  has freed slots here. While a stage is open its table entries are :class:`LostBlock` (the KV
  is in no pool) and the engine does not step (:attr:`frozen`), so nothing reads them. A
  stage_in that finds no room here borrows instead; if nobody lends, the requests affected are
  recomputed, as when a creditor dies: the tables stay consistent in every case. A stage not
  closed within ``stage_timeout_s`` (its kv_manager died midway) is closed by the engine itself.

Blocks are picked deterministically: the running requests in order, each table's blocks on the
holder by logical index. Pure domain logic: no gRPC.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.gpu_worker.distkv.block_table import BlockRef, BlockTable, LostBlock, RemoteBlock
from services.gpu_worker.distkv.borrower import Borrower
from services.gpu_worker.distkv.rmanager import RManager, write_whole_blocks
from services.gpu_worker.memory.page_allocator import PoolExhausted
from services.runtime.errors import (
    DomainError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

log = logging.getLogger("loramesh.engine")


@dataclass(frozen=True)
class _Site:
    """Logical block ``index`` of ``table``."""

    table: BlockTable
    index: int


@dataclass(frozen=True)
class _Stage:
    """Blocks read out of a holder and not yet written back here."""

    holder: str
    sites: tuple[_Site, ...]
    placeholders: tuple[LostBlock, ...]
    """What each site's entry was set to; a site whose entry changed since (its request was
    cancelled, finished or recomputed) is not written back."""
    keys: torch.Tensor
    """[num_layers, len(sites) * block_tokens, kv_dim], host memory, storage dtype."""
    values: torch.Tensor
    opened_at: float


class BlockRecalls:
    """Recalls of ``rm``'s blocks; ``tables()`` lists the running requests' block tables and
    ``recompute(table)`` sends the request owning ``table`` back to be recomputed."""

    def __init__(
        self,
        rm: RManager,
        borrower: Borrower | None,
        tables: Callable[[], Sequence[BlockTable]],
        recompute: Callable[[BlockTable], None],
        stage_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.rm = rm
        self.borrower = borrower
        self.tables = tables
        self.recompute = recompute
        self.stage_timeout_s = stage_timeout_s
        self.clock = clock
        self._stages: dict[int, _Stage] = {}
        self._ids = itertools.count(1)
        self.recalls = 0
        """Recalls completed (a staged one counts when its blocks are back in this pool)."""
        self.blocks_recalled = 0
        """Blocks brought home by those recalls."""

    @property
    def frozen(self) -> bool:
        """A stage is open: the engine must not step (some KV is in no pool)."""
        return bool(self._stages)

    def recall(self, holder: str, count: int) -> int:
        """Move ``count`` of this worker's blocks held by ``holder`` into the local pool, all or
        none; returns ``count``. ``ResourceExhausted`` when the pool has no room for them."""
        sites = self._pick(holder, count)
        try:
            fresh = self.rm.local.allocate(count)
        except PoolExhausted as full:
            raise ResourceExhausted(
                f"no room to recall {count} blocks from {holder}: {self.rm.local.free_blocks} free ({full})"
            ) from full
        try:
            write_whole_blocks(self.rm.local, fresh, self.rm.read([site.table[site.index] for site in sites]))
        except DomainError:
            self.rm.local.free(fresh)
            raise
        old = [site.table.relocate(site.index, block) for site, block in zip(sites, fresh)]
        try:
            self.rm.free(old)
        except Unavailable as gone:  # the KV is home already; the holder's death frees the rest
            log.warning("DGFM: recalled %d blocks but could not free them at %s: %s", count, holder, gone)
        self._count(count)
        return count

    def stage_out(self, holder: str, count: int) -> int:
        """First half of a staged recall: read ``count`` blocks from ``holder`` into host memory
        and free them there, all or none. Returns the stage id :meth:`stage_in` takes."""
        sites = self._pick(holder, count)
        blocks = [site.table[site.index] for site in sites]
        keys, values = self.rm.read(blocks)
        keys, values = keys.to("cpu"), values.to("cpu")
        self.rm.free(blocks)
        placeholders = tuple(LostBlock(holder, block.block_id) for block in blocks)
        for site, placeholder in zip(sites, placeholders):
            site.table.relocate(site.index, placeholder)
        stage_id = next(self._ids)
        self._stages[stage_id] = _Stage(holder, tuple(sites), placeholders, keys, values, self.clock())
        log.info("DGFM: staged %d blocks out of %s (stage %d)", count, holder, stage_id)
        return stage_id

    def stage_in(self, stage_id: int) -> int:
        """Second half: write stage ``stage_id``'s blocks back here, or borrowed elsewhere when
        this pool has no room; returns how many came home to this pool. Requests whose blocks
        found no home anywhere are recomputed. ``NotFound`` for a stage that is not open."""
        stage = self._stages.pop(stage_id, None)
        if stage is None:
            raise NotFound(f"stage {stage_id} is not open on {self.rm.worker_id} (closed already?)")
        live = [
            (k, site)
            for k, (site, placeholder) in enumerate(zip(stage.sites, stage.placeholders))
            if site.index < len(site.table) and site.table[site.index] is placeholder
        ]
        if not live:
            return 0
        homes, local = self._homes(len(live))
        if homes is None:
            log.warning("DGFM: no room anywhere for %d staged blocks; recomputing their requests", len(live))
            self._recompute({id(site.table): site.table for _, site in live}.values())
            return 0
        for (_, site), home in zip(live, homes):
            site.table.replace(site.index, home)
        broken = self._write_back(stage, live)
        self._recompute(broken)
        if not local:
            return 0
        home = sum(1 for _, site in live if site.table not in broken)
        self._count(home)
        return home

    def close_expired(self) -> None:
        """Close the stages older than ``stage_timeout_s``: their kv_manager did not finish the
        cycle (it died or lost its leadership), so nobody else will."""
        now = self.clock()
        for stage_id, stage in list(self._stages.items()):
            if now - stage.opened_at >= self.stage_timeout_s:
                log.warning(
                    "DGFM: stage %d from %s was not closed in time; closing it", stage_id, stage.holder
                )
                self.stage_in(stage_id)

    def _pick(self, holder: str, count: int) -> list[_Site]:
        if count < 1:
            raise InvalidArgument(f"a recall moves at least one block, got {count}")
        if holder == self.rm.worker_id:
            raise InvalidArgument(f"{holder} cannot recall blocks from itself")
        sites = [
            _Site(table, index)
            for table in self.tables()
            for index, block in enumerate(table)
            if isinstance(block, RemoteBlock) and block.creditor == holder
        ]
        if len(sites) < count:
            raise FailedPrecondition(
                f"{self.rm.worker_id} holds {len(sites)} of its blocks on {holder}, fewer than the "
                f"{count} to recall (the ledger was older than its tables)"
            )
        return sites[:count]

    def _homes(self, count: int) -> tuple[list[BlockRef] | None, int]:
        """``count`` blocks for staged KV: local ones, else borrowed; (None, 0) if neither."""
        try:
            return list(self.rm.local.allocate(count)), count
        except PoolExhausted:
            pass
        if self.borrower is None:
            return None, 0
        try:
            return list(self.borrower.borrow(count)), 0
        except ResourceExhausted:
            return None, 0

    def _write_back(self, stage: _Stage, live: list[tuple[int, _Site]]) -> list[BlockTable]:
        """Write each live site's staged KV into its new block; the tables a write failed for."""
        block_tokens = self.rm.block_tokens
        by_table: dict[int, tuple[BlockTable, list[int], list[int]]] = {}
        for k, site in live:
            table, rows, positions = by_table.setdefault(id(site.table), (site.table, [], []))
            rows.extend(range(k * block_tokens, (k + 1) * block_tokens))
            positions.extend(range(table.first_position(site.index), table.first_position(site.index + 1)))
        broken = []
        for table, rows, positions in by_table.values():
            index, where = torch.tensor(rows), torch.tensor(positions)
            try:
                for layer in range(stage.keys.shape[0]):
                    self.rm.write(table, layer, where, stage.keys[layer][index], stage.values[layer][index])
            except DomainError as failed:
                log.warning("DGFM: writing staged blocks back failed (%s); recomputing", failed)
                broken.append(table)
        return broken

    def _recompute(self, tables) -> None:
        for table in tables:
            self.recompute(table)

    def _count(self, blocks: int) -> None:
        self.recalls += 1
        self.blocks_recalled += blocks
