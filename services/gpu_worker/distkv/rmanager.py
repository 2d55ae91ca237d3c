"""The rManager of one worker (DistKV-LLM §4.3): its local KV blocks, the blocks it lends
(creditor side) and the blocks it borrows from each creditor (debtor side), with the
request-level operations the engine needs: grow a request's block table, write its KV, attend
over it wherever its blocks are (DistAttention), and release it.

Accounting is exact: every KV block this worker allocated is used by its own requests or lent to
exactly one debtor, and every borrowed block is held from exactly one creditor
(:meth:`RManager.accounting`). Pure domain logic: creditors are reached through a
``CreditorTransport``; who to borrow from is the caller's choice (the gManager suggests).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.gpu_worker.attention.chunked_attention import combine_in_block_order
from services.gpu_worker.attention.dist_attention import PartialAttention, empty_partial, scale_reduce
from services.gpu_worker.attention.pool_block_attention import attend_pool_blocks
from services.gpu_worker.distkv.block_lender import BlockLender, LendingConfig
from services.gpu_worker.distkv.block_table import BlockRef, BlockTable, LocalBlock, LostBlock, RemoteBlock
from services.gpu_worker.distkv.kv_block_allocator import AttendSegment, BlockT, KvBlockAllocator, KvRows
from services.gpu_worker.distkv.local_block_allocator import LocalBlockAllocator
from services.gpu_worker.distkv.remote_block_allocator import CreditorTransport, Pending, RemoteBlockAllocator
from services.gpu_worker.kernels.cpu_invariant import invariant_available
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.runtime.errors import DomainError, FailedPrecondition, InvalidArgument, NotFound, Unavailable

log = logging.getLogger("loramesh.engine")


@dataclass(frozen=True)
class BlockAccounting:
    """Where this worker's KV blocks are, for heartbeats, metrics and leak checks."""

    free_blocks: int
    """Blocks the local pool could still hand out."""
    local_blocks: int
    """Local blocks used by this worker's own requests."""
    lent_blocks: dict[str, int]
    """Local blocks lent out, per debtor."""
    borrowed_blocks: dict[str, int]
    """Blocks held on other workers, per creditor (creditors with none left out)."""


@dataclass(frozen=True)
class TableQueries:
    """One request's queries in one layer, and its block table."""

    table: BlockTable
    """Where the request's KV blocks are."""
    queries: torch.Tensor
    """[n, num_heads, head_dim]: the rotated queries of its new tokens."""
    positions: torch.Tensor
    """int64 [n]: their token positions."""
    keys: torch.Tensor | None = None
    """[n, kv_dim]: the new tokens' keys, stored before attending (None: stored already)."""
    values: torch.Tensor | None = None
    """[n, kv_dim]: their values, with ``keys``."""


@dataclass(frozen=True)
class _PlannedSegment:
    """One request's blocks on one holder, as a step attends over them in every layer."""

    request: int
    """Index of the request in the step's list."""
    blocks: list[BlockRef]
    wire_blocks: list
    """``blocks`` as their holder names them (local blocks, or a creditor's block ids)."""
    firsts: list[int]
    """Token position of each block's first slot."""
    rows: torch.Tensor | None
    """The request's queries that see one of the blocks (None: all of them)."""
    positions: torch.Tensor
    """The positions of the request's new tokens."""
    pages: torch.Tensor | None
    """Local blocks: their pages, int64 [num_layers, blocks] (None on a creditor)."""
    first_positions: torch.Tensor
    """``firsts`` as int64."""

    def segment(self, queries: torch.Tensor) -> AttendSegment:
        """The segment of this layer's ``queries`` (the request's, [n, heads, head_dim])."""
        positions = self.positions
        if self.rows is not None:
            queries, positions = queries[self.rows], positions[self.rows]
        return AttendSegment(queries, positions, self.wire_blocks, self.firsts)


@dataclass(frozen=True)
class AttentionPlan:
    """A step's attention over its borrowing requests' blocks, the same in every layer."""

    writes: list[dict[str | None, tuple[list[BlockRef], torch.Tensor, torch.Tensor]]]
    """Per request, per holder: the blocks its new tokens go to, their rows and slots."""
    segments: dict[str | None, list[_PlannedSegment]]
    """Per holder (None: this pool), the requests' blocks there."""


class RManager:
    """The KV blocks of worker ``worker_id``: local, lent and borrowed."""

    def __init__(
        self, worker_id: str, pool: UnifiedPool, lending: LendingConfig, batch_invariant: bool = False
    ):
        """``batch_invariant`` (deterministic serving): attend block by block and combine in block
        order, so a request with borrowed blocks gets the bits the local path would give it."""
        self.worker_id = worker_id
        self.batch_invariant = batch_invariant
        self.local = LocalBlockAllocator(pool)
        self._native_combine = pool.device.type == "cpu" and invariant_available()
        self.lender = BlockLender(self.local, lending)
        self._creditors: dict[str, RemoteBlockAllocator] = {}

    @property
    def block_tokens(self) -> int:
        return self.local.block_tokens

    def new_table(self) -> BlockTable:
        return BlockTable(self.block_tokens)

    def connect(self, creditor: str, transport: CreditorTransport) -> RemoteBlockAllocator:
        """Be able to borrow from ``creditor`` (idempotent while it lives)."""
        if creditor not in self._creditors:
            self._creditors[creditor] = RemoteBlockAllocator(self.worker_id, creditor, transport)
        return self._creditors[creditor]

    def reserve_local(self, table: BlockTable, num_tokens: int) -> None:
        """Grow ``table`` with local blocks to hold ``num_tokens`` (``PoolExhausted``: nothing added)."""
        table.append(self.local.allocate(table.blocks_needed(num_tokens)))

    def borrow(self, creditor: str, count: int) -> list[RemoteBlock]:
        """Borrow ``count`` blocks from ``creditor`` (its refusal, ``ResourceExhausted``, borrows none)."""
        return self._creditor(creditor).allocate(count)

    def write(
        self, table: BlockTable, layer: int, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store one layer's ``keys``/``values`` [n, kv_dim] of the tokens at ``positions`` [n],
        each in its logical block, wherever that block lives (one call per holder)."""
        for holder, (blocks, index, slots) in self._rows_by_holder(table, positions).items():
            self._allocator(holder).write(layer, KvRows(blocks, slots, keys[index], values[index]))

    def store(
        self, table: BlockTable, layer: int, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> list[Pending[None]]:
        """:meth:`write` without waiting for creditors: the local rows are stored now, the remote
        ones are on their way (one call per creditor), done when every returned call is."""
        pending = []
        for holder, (blocks, index, slots) in self._rows_by_holder(table, positions).items():
            rows = KvRows(blocks, slots, keys[index], values[index])
            if holder is None:
                self.local.write(layer, rows)
            else:
                pending.append(self._creditor(holder).write_async(layer, rows))
        return pending

    def _rows_by_holder(
        self, table: BlockTable, positions: torch.Tensor
    ) -> dict[str | None, tuple[list[BlockRef], torch.Tensor, torch.Tensor]]:
        """Per holder, the blocks of the tokens at ``positions`` that it holds, the rows of those
        tokens and their slots in the blocks."""
        by_holder: dict[str | None, list[int]] = {}
        blocks: list[BlockRef] = []
        for row, position in enumerate(positions.tolist()):
            block = self._block_at(table, position)
            blocks.append(block)
            by_holder.setdefault(_holder(block), []).append(row)
        slots = positions % self.block_tokens
        grouped = {}
        for holder, rows in by_holder.items():
            index = torch.tensor(rows, dtype=torch.int64, device=positions.device)
            grouped[holder] = ([blocks[r] for r in rows], index, slots[index])
        return grouped

    def plan_attention(self, requests: Sequence[tuple[BlockTable, torch.Tensor]]) -> AttentionPlan:
        """Where each request's new rows go and which blocks its queries attend over, per holder,
        for requests given as (block table, positions of their new tokens): the same in every
        layer of a step, so a step plans once (walking a long context's blocks in Python per layer
        cost ~20 ms a step)."""
        writes = []
        segments: dict[str | None, list[_PlannedSegment]] = {}
        for index, (table, positions) in enumerate(requests):
            writes.append(self._rows_by_holder(table, positions))
            horizon = int(positions.max()) if positions.numel() else -1
            groups: list[tuple[str | None, list[BlockRef], list[int]]] = []
            per_holder: dict[str | None, tuple[list[BlockRef], list[int]]] = {}
            for logical in range(len(table)):
                first = table.first_position(logical)
                if first > horizon:
                    break
                block = self._block_at(table, first)
                if self.batch_invariant:
                    groups.append((_holder(block), [block], [first]))
                    continue
                held, firsts = per_holder.setdefault(_holder(block), ([], []))
                held.append(block)
                firsts.append(first)
            groups += [(holder, held, firsts) for holder, (held, firsts) in per_holder.items()]
            for holder, held, firsts in groups:
                seen = positions >= firsts[0]  # blocks come in position order
                rows = None if bool(seen.all()) else seen.nonzero().squeeze(1)
                wire = held if holder is None else self._creditor(holder).wire_ids(held)
                pages = self.local.page_table(held) if holder is None else None
                segments.setdefault(holder, []).append(
                    _PlannedSegment(
                        index,
                        held,
                        wire,
                        firsts,
                        rows,
                        positions,
                        pages,
                        torch.tensor(firsts, dtype=torch.int64),
                    )
                )
        return AttentionPlan(writes, segments)

    def attend(
        self, layer: int, requests: Sequence[TableQueries], plan: AttentionPlan | None = None
    ) -> list[torch.Tensor]:
        """Per request, float32 [n, num_heads, head_dim]: exact causal attention of its queries
        over its whole context, as micro-attentions where its blocks are, scale-reduced here.
        ``plan``: :meth:`plan_attention` of the same requests (None: planned here).

        A request's new KV (``keys``/``values``) is stored first, its remote rows in the same
        call as the attention there: one round trip per creditor for all requests, sent before
        the local blocks are attended over so that the two overlap. Blocks in every query's
        future are skipped, and a creditor gets only the queries that see its blocks.

        Batch-invariant: one segment per block (the queries travel once per block), and the
        block partials combined in block order (``chunked_attention``)."""
        if plan is None:
            plan = self.plan_attention([(r.table, r.positions) for r in requests])
        writes: dict[str | None, list[KvRows]] = {}
        for request, by_holder in zip(requests, plan.writes):
            if request.keys is not None:
                for holder, (blocks, index, slots) in by_holder.items():
                    rows = KvRows(blocks, slots, request.keys[index], request.values[index])
                    writes.setdefault(holder, []).append(rows)
        for rows in writes.pop(None, []):
            self.local.write(layer, rows)
        segments = {
            holder: [planned.segment(requests[planned.request].queries) for planned in planned_segments]
            for holder, planned_segments in plan.segments.items()
        }
        pending = {
            holder: self._creditor(holder).attend_wire(
                layer, segments.get(holder, []), _joined(writes.get(holder))
            )
            for holder in {*segments, *writes} - {None}
        }
        partials: list[list] = [[] for _ in requests]

        def collect(holder: str | None, results: list[PartialAttention]) -> None:
            for planned, partial in zip(plan.segments.get(holder, []), results):
                partial = _spread(partial, planned.rows, requests[planned.request].queries.shape[0])
                partials[planned.request].append((planned.firsts[0], partial))

        if None in segments:  # its blocks checked and their pages looked up by the plan
            collect(
                None,
                [
                    attend_pool_blocks(
                        self.local.pool,
                        planned.pages[layer],
                        planned.first_positions,
                        s.queries,
                        s.query_positions,
                    )
                    for planned, s in zip(plan.segments[None], segments[None])
                ],
            )
        for holder, answer in pending.items():
            collect(holder, answer.result())
        outputs = []
        for request, parts in zip(requests, partials):
            n, heads, head_dim = request.queries.shape
            if not parts:
                outputs.append(empty_partial(n, heads, head_dim, request.queries.device).output)
            elif self.batch_invariant or self._native_combine:
                # In block order (what batch-invariant serving needs), in one native call where
                # there is one: scale_reduce is ten torch ops, once per layer.
                in_order = [partial for _, partial in sorted(parts, key=lambda part: part[0])]
                outputs.append(combine_in_block_order(in_order).output)
            else:
                outputs.append(scale_reduce([p for _, p in parts]).output)
        return outputs

    def release(self, table: BlockTable) -> list[str]:
        """Free every block of ``table`` where it lives (lost blocks have nothing left to free).
        A creditor that cannot be reached, or refuses the free, does not stop the others being
        freed; returns those creditors (their blocks went with them, or are theirs again: the
        caller processes their death, which releases anything still lent)."""
        by_holder: dict[str | None, list[BlockRef]] = {}
        for block in table.take_all():
            if not isinstance(block, LostBlock):
                by_holder.setdefault(_holder(block), []).append(block)
        unreachable = []
        for holder, held in by_holder.items():
            try:
                self._allocator(holder).free(held)
            except Unavailable:
                unreachable.append(holder)
            except DomainError as refused:
                if holder is None:
                    raise  # our own pool refusing its own blocks is a bug, not a lost creditor
                log.warning(
                    "creditor %s refused to free %d blocks, taken as lost: %s", holder, len(held), refused
                )
                unreachable.append(holder)
        return unreachable

    def free(self, blocks: Sequence[BlockRef]) -> None:
        """Free ``blocks`` where they live, one call per holder."""
        by_holder: dict[str | None, list[BlockRef]] = {}
        for block in blocks:
            by_holder.setdefault(_holder(block), []).append(block)
        for holder, held in by_holder.items():
            self._allocator(holder).free(held)

    def move(self, table: BlockTable, indices: Sequence[int], to: str | None) -> int:
        """Move blocks ``indices`` of ``table`` to holder ``to`` (None: this worker's pool, else a
        creditor), their KV copied bit for bit and the old blocks freed: DGFM's recall and swap
        (§4.5). All or none: if ``to`` refuses or a copy fails, the table is as it was. Returns
        how many blocks moved (those already at ``to`` stay)."""
        moving = [i for i in dict.fromkeys(indices) if _holder(_live(table, i)) != to]
        if not moving:
            return 0
        destination = self._allocator(to)
        fresh = dict(zip(moving, destination.allocate(len(moving))))
        by_holder: dict[str | None, list[int]] = {}
        for index in moving:
            by_holder.setdefault(_holder(_live(table, index)), []).append(index)
        try:
            for holder, held in by_holder.items():
                kv = self._allocator(holder).read([table[i] for i in held])
                write_whole_blocks(destination, [fresh[i] for i in held], kv)
        except DomainError:
            # An unreachable destination frees its blocks when its death is processed.
            with contextlib.suppress(Unavailable):
                destination.free(list(fresh.values()))
            raise
        self.free([table.relocate(i, fresh[i]) for i in moving])
        return len(moving)

    def read(self, blocks: Sequence[BlockRef]) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole KV of ``blocks``, all on one holder, in every layer (DGFM's staged recall)."""
        holders = {_holder(block) for block in blocks}
        if len(holders) != 1:
            raise InvalidArgument(f"read takes the blocks of one holder, got {len(holders)} holders")
        return self._allocator(holders.pop()).read(list(blocks))

    def creditor_died(self, creditor: str, tables: Sequence[BlockTable]) -> dict[int, list[int]]:
        """``creditor`` is gone: mark its blocks lost in ``tables`` and stop borrowing from it.
        Returns, per affected table (by position in ``tables``), the logical blocks lost."""
        allocator = self._creditors.pop(creditor, None)
        if allocator is not None:
            allocator.creditor_lost()
        lost = {i: table.mark_lost(creditor) for i, table in enumerate(tables)}
        return {i: blocks for i, blocks in lost.items() if blocks}

    def debtor_died(self, debtor: str) -> int:
        """``debtor`` is gone (its lease expired): take back every block lent to it; how many."""
        return self.lender.reclaim(debtor)

    def accounting(self) -> BlockAccounting:
        lent = self.lender.lent_to()
        return BlockAccounting(
            free_blocks=self.local.free_blocks,
            local_blocks=self.local.allocated_blocks - sum(lent.values()),
            lent_blocks=lent,
            borrowed_blocks=self.borrowed(),
        )

    def borrowed(self) -> dict[str, int]:
        """Blocks held on other workers, per creditor (creditors with none left out)."""
        return {c: a.held_blocks for c, a in self._creditors.items() if a.held_blocks}

    def _block_at(self, table: BlockTable, position: int) -> BlockRef:
        index = position // self.block_tokens
        if not 0 <= index < len(table):
            raise InvalidArgument(f"position {position} is outside the request's {table.capacity} tokens")
        return _live(table, index)

    def _allocator(self, holder: str | None) -> KvBlockAllocator:
        return self.local if holder is None else self._creditor(holder)

    def _creditor(self, creditor: str) -> RemoteBlockAllocator:
        allocator = self._creditors.get(creditor)
        if allocator is None:
            raise NotFound(f"worker {self.worker_id} is not connected to creditor {creditor}")
        return allocator


def _live(table: BlockTable, index: int) -> BlockRef:
    """Block ``index`` of ``table``, which must not be lost."""
    block = table[index]
    if isinstance(block, LostBlock):
        raise FailedPrecondition(
            f"block {index} was lost with creditor {block.creditor}; recompute it before using it"
        )
    return block


def write_whole_blocks(
    allocator: KvBlockAllocator[BlockT], blocks: Sequence[BlockT], kv: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """Fill every slot of ``blocks`` in every layer with ``kv``, what ``read`` returned for as many
    blocks: keys and values [num_layers, len(blocks) * kv_block_tokens, kv_dim]."""
    keys, values = kv
    block_tokens = keys.shape[1] // len(blocks) if blocks else 0
    targets = [block for block in blocks for _ in range(block_tokens)]
    slots = torch.arange(block_tokens, device=keys.device).repeat(len(blocks))
    for layer in range(keys.shape[0]):
        allocator.write(layer, KvRows(targets, slots, keys[layer], values[layer]))


def _holder(block: BlockRef) -> str | None:
    """None for a local block, else its creditor."""
    return None if isinstance(block, LocalBlock) else block.creditor


def _joined(rows: list[KvRows] | None) -> KvRows | None:
    """Several requests' rows for one holder as one write (None: nothing to write)."""
    if not rows:
        return None
    if len(rows) == 1:
        return rows[0]
    return KvRows(
        [block for r in rows for block in r.blocks],
        torch.cat([r.slots for r in rows]),
        torch.cat([r.keys for r in rows]),
        torch.cat([r.values for r in rows]),
    )


def _spread(partial: PartialAttention, rows: torch.Tensor | None, n: int) -> PartialAttention:
    """``partial`` of the queries at ``rows`` as the partial of all ``n`` queries: the others saw
    none of its keys (None: it is of all of them already)."""
    if rows is None:
        return partial
    whole = empty_partial(n, partial.output.shape[1], partial.output.shape[2], partial.output.device)
    whole.output[rows] = partial.output
    whole.lse[rows] = partial.lse
    return whole
