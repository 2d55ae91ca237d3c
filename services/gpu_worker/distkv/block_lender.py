"""The creditor side of the rManager (DistKV-LLM §4.3–4.4): lends KV blocks of this worker's
pool to other workers (debtors), stores the KV they write there, frees them, and answers their
queries with partial attention over exactly the blocks each debtor owns.

Remote callers are untrusted input: every call is checked before anything changes, and a bad one
raises a :mod:`services.runtime.errors` domain error naming what is wrong (the servicer maps it
to a status) while the blocks of every other debtor stay as they were. Lent block ids are never
reused, so a stale id can only name a freed block, never someone else's; not even across a restart
under the same instance id (a pod's container restarted in place): each lender numbers its loans
from the wall clock's nanoseconds at its start, above every id a predecessor could have lent, and
refuses an id it never lent as :class:`NotLent`, as it does one it took back when the debtor's
lease expired: either tells the debtor its blocks here are lost.

Not thread-safe: like the pool it draws from, it belongs to the engine thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.gpu_worker.attention.dist_attention import PartialAttention
from services.gpu_worker.distkv.block_table import LocalBlock
from services.gpu_worker.distkv.kv_block_allocator import AttendCall, AttendSegment, KvRows
from services.gpu_worker.distkv.local_block_allocator import LocalBlockAllocator
from services.gpu_worker.memory.page_allocator import PoolExhausted
from services.runtime.errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)


@dataclass(frozen=True)
class LendingConfig:
    """How much of this worker's pool other workers may borrow."""

    max_lent_blocks: int
    """Cap on blocks lent out to all debtors together (the paper's hyperparameter); 0 lends
    nothing. Allocations past it are refused, so local requests keep room of their own."""


class NotLent(NotFound):
    """A block id not lent to the caller now: freed (by the debtor, or taken back when the
    debtor's lease expired), or never lent by this process (the debtor holds it from an earlier
    process that ran under this worker's id, whose KV went with it). Either way the debtor's KV
    there is gone: it recomputes."""


@dataclass(frozen=True)
class _Loan:
    debtor: str
    """The worker the block is lent to: the only one that may write, attend over or free it."""
    block: LocalBlock
    """Its pages in this worker's pool."""


class BlockLender:
    """Blocks of ``local`` lent to debtors, by lent block id."""

    def __init__(self, local: LocalBlockAllocator, config: LendingConfig, first_id: int | None = None):
        """``first_id``: the id of the first loan (None: the wall clock's nanoseconds now, so a
        lender restarted under the same worker id starts above its predecessor's ids, which
        advanced by one per loan, far slower than the clock)."""
        if config.max_lent_blocks < 0:
            raise ValueError(f"max_lent_blocks must be ≥ 0, got {config.max_lent_blocks}")
        self.local = local
        self.config = config
        self._loans: dict[int, _Loan] = {}
        self._by_debtor: dict[str, set[int]] = {}
        self._first_id = time.time_ns() if first_id is None else first_id
        self._next_id = self._first_id

    @property
    def lent_blocks(self) -> int:
        return len(self._loans)

    def lent_to(self) -> dict[str, int]:
        """Blocks lent, per debtor (for heartbeats and metrics)."""
        return {debtor: len(ids) for debtor, ids in self._by_debtor.items()}

    def blocks_of(self, debtor: str) -> list[int]:
        return sorted(self._by_debtor.get(debtor, ()))

    def allocate(self, debtor: str, count: int) -> list[int]:
        """Lend ``count`` blocks to ``debtor`` (first free pages), all or none; their ids."""
        if count <= 0:
            raise InvalidArgument(f"a remote allocation must ask for at least one block, got {count}")
        cap = self.config.max_lent_blocks
        if self.lent_blocks + count > cap:
            raise ResourceExhausted(
                f"lending {count} more blocks would exceed the cap of {cap} blocks lent out "
                f"({self.lent_blocks} lent now)"
            )
        try:
            blocks = self.local.allocate(count)
        except PoolExhausted as exhausted:
            # A creditor never borrows on behalf of a remote request (§4.4): it refuses.
            raise ResourceExhausted(
                f"no room for {count} blocks in this worker's pool ({exhausted})"
            ) from exhausted
        ids = list(range(self._next_id, self._next_id + count))
        self._next_id += count
        for block_id, block in zip(ids, blocks):
            self._loans[block_id] = _Loan(debtor, block)
        self._by_debtor.setdefault(debtor, set()).update(ids)
        return ids

    def write(self, debtor: str, layer: int, rows: KvRows[int]) -> None:
        """Store ``debtor``'s KV: token ``i`` goes to slot ``rows.slots[i]`` of block ``rows.blocks[i]``."""
        self._check_layer(layer)
        self.local.write(layer, self._checked_rows(debtor, rows))

    def _checked_rows(self, debtor: str, rows: KvRows[int]) -> KvRows[LocalBlock]:
        """``rows`` on the pages of ``debtor``'s blocks, every shape and slot checked."""
        blocks = self._owned(debtor, rows.blocks)
        n, kv_dim = len(blocks), self.local.pool.layout.kv_dim
        for name, tensor in (("keys", rows.keys), ("values", rows.values)):
            if tuple(tensor.shape) != (n, kv_dim):
                raise InvalidArgument(f"{name} must be [{n}, {kv_dim}], got {list(tensor.shape)}")
        slots = rows.slots
        if slots.shape != (n,) or (
            n and not (0 <= int(slots.min()) and int(slots.max()) < self.local.block_tokens)
        ):
            raise InvalidArgument(f"slots must be {n} values in [0, {self.local.block_tokens})")
        return KvRows(blocks, slots, rows.keys, rows.values)

    def free(self, debtor: str, block_ids: Sequence[int]) -> None:
        """Take back ``debtor``'s ``block_ids``, all or none."""
        if len(set(block_ids)) != len(block_ids):
            raise InvalidArgument("the same block id appears twice in one free")
        blocks = self._owned(debtor, block_ids)
        for block_id in block_ids:
            del self._loans[block_id]
            self._by_debtor[debtor].discard(block_id)
        if not self._by_debtor[debtor]:
            del self._by_debtor[debtor]
        self.local.free(blocks)

    def reclaim(self, debtor: str) -> int:
        """Free every block lent to ``debtor`` (it died: its etcd lease expired); how many."""
        ids = self.blocks_of(debtor)
        if ids:
            self.free(debtor, ids)
        return len(ids)

    def attend(self, debtor: str, call: AttendCall[int]) -> list[PartialAttention]:
        """Partial attention of each segment's queries over its blocks, all owned by ``debtor``;
        the call's ``write`` (the debtor's new tokens) is stored first. Everything is checked
        before anything is stored."""
        layer = call.layer
        self._check_layer(layer)
        rows = self._checked_rows(debtor, call.write) if call.write is not None else None
        local_segments = []
        for segment in call.segments:
            blocks = self._owned(debtor, segment.blocks)
            queries, positions = segment.queries, segment.query_positions
            self._check_queries(queries, positions)
            if len(segment.block_first_positions) != len(blocks):
                raise InvalidArgument(
                    f"{len(blocks)} blocks but {len(segment.block_first_positions)} block positions"
                )
            local_segments.append(AttendSegment(queries, positions, blocks, segment.block_first_positions))
        if rows is not None:
            self.local.write(layer, rows)
        return self.local.attend(layer, local_segments)

    def read(self, debtor: str, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The KV of ``debtor``'s ``block_ids`` in every layer, for the debtor to move them."""
        return self.local.read(self._owned(debtor, block_ids))

    def pages_of(self, debtor: str, block_ids: Sequence[int]) -> list[tuple[int, ...]]:
        """The pages (one per layer) of ``debtor``'s ``block_ids``, for a debtor that maps this
        pool (the shared-memory lane)."""
        return [block.pages for block in self._owned(debtor, block_ids)]

    def _owned(self, debtor: str, block_ids: Sequence[int]) -> list[LocalBlock]:
        """The blocks behind ``block_ids``, each checked to be lent to ``debtor``."""
        blocks = []
        for block_id in block_ids:
            loan = self._loans.get(block_id)
            if loan is None:
                if self._first_id <= block_id < self._next_id:
                    raise NotLent(
                        f"block {block_id} was freed; it is no longer lent to {debtor} (freed by it, "
                        "or taken back when its lease expired)"
                    )
                raise NotLent(
                    f"block {block_id} was never lent by this worker process (lent by one before it "
                    "under the same id, its KV is gone)"
                )
            if loan.debtor != debtor:
                raise PermissionDenied(f"block {block_id} is not lent to {debtor}")
            blocks.append(loan.block)
        return blocks

    def _check_queries(self, queries: torch.Tensor, positions: torch.Tensor) -> None:
        """Queries must be [n, heads, head_dim] in this pool's kv heads' groups, one position each."""
        kv_dim = self.local.pool.layout.kv_dim
        shape = list(queries.shape)
        if len(shape) != 3 or not shape[2] or kv_dim % shape[2] or shape[1] % (kv_dim // shape[2]):
            raise InvalidArgument(
                f"queries must be [n, heads, head_dim] with head_dim dividing {kv_dim} and heads a "
                f"multiple of the kv heads, got {shape}"
            )
        if positions.shape != (shape[0],):
            raise InvalidArgument(f"query_positions must be [{shape[0]}], got {list(positions.shape)}")

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.local.num_layers:
            raise InvalidArgument(f"layer {layer} is out of range [0, {self.local.num_layers})")
