"""Where a request's KV goes when the pool cannot hold its next block: the engine's one
KV-overflow interface, :class:`KvOverflow`, and its two settings (``kv_overflow``):
:class:`Preemption` (nothing beyond the pool: the engine preempts a victim) and :class:`Borrowing`
(DistKV-LLM: the request's blocks move to an rManager block table and grow with blocks borrowed
from other workers, suggested by the kv_manager).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from services.gpu_worker.distkv.block_table import BlockTable
from services.gpu_worker.distkv.borrower import Borrower, MeshCannotLend
from services.gpu_worker.distkv.rmanager import RManager
from services.gpu_worker.memory.kv_cache import KvTable
from services.gpu_worker.memory.page_allocator import PoolExhausted
from services.runtime.errors import ResourceExhausted


class SpillingRequest(Protocol):
    """What overflow needs of a request: its local KV and, once spilled, its block table."""

    kv: KvTable
    table: BlockTable | None


R = TypeVar("R", bound=SpillingRequest)


class KvOverflow(Protocol):
    """What the pool does for a request whose next KV block it cannot hold."""

    refusal: str | None
    """Why the last spill can never succeed, whatever frees up (None: it may later)."""
    shortfall: str | None
    """Why the last spill found no loan for what the pool could not hold (None: it borrowed
    what it needed, or it borrows nothing)."""

    def spill(self, request: SpillingRequest, tokens: int) -> None:
        """Hold ``request``'s KV for ``tokens`` tokens beyond the pool (and grow it there after),
        or raise ``PoolExhausted``: the caller preempts a victim."""

    def release(self, request: SpillingRequest) -> list[str]:
        """Free what ``request`` holds beyond the pool; the creditors found gone meanwhile."""

    def lost_with(self, creditor: str, running: Sequence[R]) -> list[R]:
        """The ``running`` requests that had blocks on ``creditor``, gone with them (to recompute)."""

    def hopeless(self) -> bool:
        """Whether nothing beyond the pool can ever hold a request the pool cannot."""


class Preemption:
    """``kv_overflow: preempt``: nothing beyond the pool."""

    refusal: str | None = None
    shortfall: str | None = None

    def spill(self, request: SpillingRequest, tokens: int) -> None:
        raise PoolExhausted(request.kv.pages_needed(tokens), 0)

    def release(self, request: SpillingRequest) -> list[str]:
        return []

    def lost_with(self, creditor: str, running: Sequence[R]) -> list[R]:
        return []

    def hopeless(self) -> bool:
        return True


class Borrowing:
    """``kv_overflow: borrow``: a spilled request's blocks are in a block table of ``rm``, local
    ones where they were; it grows with local blocks while ``room_blocks()`` says the pool has them
    (``make_room(pages)`` evicts for them), then with blocks ``borrower`` borrows."""

    def __init__(
        self,
        rm: RManager,
        borrower: Borrower,
        make_room: Callable[[int], None],
        room_blocks: Callable[[], int],
    ):
        self.rm = rm
        self.borrower = borrower
        self.make_room = make_room
        self.room_blocks = room_blocks
        self.refusal: str | None = None
        """Why the last borrow failed when it asked for more than the other workers would ever
        lend (None: it did not)."""
        self.shortfall: str | None = None
        """Why the last borrow failed (None: it did not)."""

    def spill(self, request: SpillingRequest, tokens: int) -> None:
        self.refusal = self.shortfall = None
        if request.table is None:  # from now on its blocks are in a block table
            request.table = self.rm.new_table()
            request.table.append(self.rm.local.adopt(request.kv.hand_over(), set(request.kv.shared)))
        table = request.table
        missing = table.blocks_needed(tokens)
        if not missing:
            return
        local = min(missing, self.room_blocks())
        if local:
            try:
                self.make_room(local * self.rm.local.num_layers)
                self.rm.reserve_local(table, table.capacity + local * table.block_tokens)
            except PoolExhausted:  # a lending call took the pages meanwhile
                local = 0
        try:
            table.append(self.borrower.borrow(missing - local))
        except MeshCannotLend as beyond:
            self.refusal = self.shortfall = beyond.message
            raise PoolExhausted(missing - local, 0) from beyond
        except ResourceExhausted as no_lender:
            self.shortfall = no_lender.message
            raise PoolExhausted(missing - local, 0) from no_lender

    def release(self, request: SpillingRequest) -> list[str]:
        if request.table is None:
            return []
        table, request.table = request.table, None
        return self.rm.release(table)

    def lost_with(self, creditor: str, running: Sequence[R]) -> list[R]:
        borrowing = [r for r in running if r.table is not None]
        lost = self.rm.creditor_died(creditor, [r.table for r in borrowing])
        return [borrowing[index] for index in lost]

    def hopeless(self) -> bool:
        return self.refusal is not None
