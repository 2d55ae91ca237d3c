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
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.gpu_worker.memory.block_lender import BlockLender, LendingConfig
from services.gpu_worker.memory.block_table import BlockRef, BlockTable, LocalBlock, LostBlock, RemoteBlock
from services.gpu_worker.memory.kv_block_allocator import AttendSegment, KvBlockAllocator
from services.gpu_worker.memory.local_block_allocator import LocalBlockAllocator
from services.gpu_worker.memory.prefill_plan import PrefillPlan
from services.gpu_worker.memory.remote_block_allocator import CreditorTransport, RemoteBlockAllocator
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.gpu_worker.model.chunked_attention import combine_in_block_order
from services.gpu_worker.model.dist_attention import empty_partial, scale_reduce
from services.runtime.errors import DomainError, FailedPrecondition, InvalidArgument, NotFound, Unavailable


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

    def place_prefill(self, table: BlockTable, plan: PrefillPlan) -> None:
        """Fill the empty ``table`` as ``plan`` says: its local blocks allocated here, its remote
        ones (already granted) as planned; the granted blocks it does not need are given back."""
        if len(table):
            raise FailedPrecondition(f"a prefill plan fills an empty table; this one has {len(table)} blocks")
        table.append(self.local.allocate(plan.local_blocks))
        table.append([planned.remote for planned in plan.blocks[plan.local_blocks :]])
        self.free([RemoteBlock(g.creditor, block_id) for g in plan.surplus for block_id in g.block_ids])

    def write(
        self, table: BlockTable, layer: int, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store one layer's ``keys``/``values`` [n, kv_dim] of the tokens at ``positions`` [n],
        each in its logical block, wherever that block lives (one call per holder)."""
        by_holder: dict[str | None, list[int]] = {}
        blocks: list[BlockRef] = []
        for row, position in enumerate(positions.tolist()):
            block = self._block_at(table, position)
            blocks.append(block)
            by_holder.setdefault(self._holder(block), []).append(row)
        slots = positions % self.block_tokens
        for holder, rows in by_holder.items():
            index = torch.tensor(rows, dtype=torch.int64, device=positions.device)
            self._allocator(holder).write(
                layer, [blocks[r] for r in rows], slots[index], keys[index], values[index]
            )

    def attend(self, layer: int, requests: Sequence[TableQueries]) -> list[torch.Tensor]:
        """Per request, float32 [n, num_heads, head_dim]: exact causal attention of its queries
        over its whole context, as micro-attentions where its blocks are, scale-reduced here.
        Each holder gets one call for all requests; blocks in every query's future are skipped.

        Batch-invariant: one segment per block (the queries travel once per block), and the
        block partials combined in block order (``chunked_attention``)."""
        segments: dict[str | None, list[tuple[int, AttendSegment]]] = {}
        for index, request in enumerate(requests):
            horizon = int(request.positions.max()) if request.positions.numel() else -1
            per_holder: dict[str | None, tuple[list[BlockRef], list[int]]] = {}
            for logical in range(len(request.table)):
                first = request.table.first_position(logical)
                if first > horizon:
                    break
                block = self._block_at(request.table, first)
                if self.batch_invariant:
                    segment = AttendSegment(request.queries, request.positions, [block], [first])
                    segments.setdefault(self._holder(block), []).append((index, segment))
                    continue
                held, firsts = per_holder.setdefault(self._holder(block), ([], []))
                held.append(block)
                firsts.append(first)
            for holder, (held, firsts) in per_holder.items():
                segment = AttendSegment(request.queries, request.positions, held, firsts)
                segments.setdefault(holder, []).append((index, segment))
        partials: list[list] = [[] for _ in requests]
        for holder, indexed in segments.items():
            results = self._allocator(holder).attend(layer, [segment for _, segment in indexed])
            for (index, segment), partial in zip(indexed, results):
                partials[index].append((segment.block_first_positions[0], partial))
        outputs = []
        for request, parts in zip(requests, partials):
            n, heads, head_dim = request.queries.shape
            if not parts:
                outputs.append(empty_partial(n, heads, head_dim, request.queries.device).output)
            elif self.batch_invariant:  # one partial per block: in block order
                in_order = [partial for _, partial in sorted(parts, key=lambda part: part[0])]
                outputs.append(combine_in_block_order(in_order).output)
            else:
                outputs.append(scale_reduce([p for _, p in parts]).output)
        return outputs

    def release(self, table: BlockTable) -> list[str]:
        """Free every block of ``table`` where it lives (lost blocks have nothing left to free).
        A creditor that cannot be reached does not stop the others being freed; returns those
        creditors (their blocks went with them: the caller processes their death)."""
        by_holder: dict[str | None, list[BlockRef]] = {}
        for block in table.take_all():
            if not isinstance(block, LostBlock):
                by_holder.setdefault(self._holder(block), []).append(block)
        unreachable = []
        for holder, held in by_holder.items():
            try:
                self._allocator(holder).free(held)
            except Unavailable:
                unreachable.append(holder)
        return unreachable

    def free(self, blocks: Sequence[BlockRef]) -> None:
        """Free ``blocks`` where they live, one call per holder."""
        by_holder: dict[str | None, list[BlockRef]] = {}
        for block in blocks:
            by_holder.setdefault(self._holder(block), []).append(block)
        for holder, held in by_holder.items():
            self._allocator(holder).free(held)

    def move(self, table: BlockTable, indices: Sequence[int], to: str | None) -> int:
        """Move blocks ``indices`` of ``table`` to holder ``to`` (None: this worker's pool, else a
        creditor), their KV copied bit for bit and the old blocks freed: DGFM's recall and swap
        (§4.5). All or none: if ``to`` refuses or a copy fails, the table is as it was. Returns
        how many blocks moved (those already at ``to`` stay)."""
        moving = [i for i in dict.fromkeys(indices) if self._holder(self._live(table, i)) != to]
        if not moving:
            return 0
        destination = self._allocator(to)
        fresh = dict(zip(moving, destination.allocate(len(moving))))
        by_holder: dict[str | None, list[int]] = {}
        for index in moving:
            by_holder.setdefault(self._holder(self._live(table, index)), []).append(index)
        try:
            for holder, held in by_holder.items():
                keys, values = self._allocator(holder).read([table[i] for i in held])
                targets = [fresh[i] for i in held for _ in range(self.block_tokens)]
                slots = torch.arange(self.block_tokens, device=keys.device).repeat(len(held))
                for layer in range(keys.shape[0]):
                    destination.write(layer, targets, slots, keys[layer], values[layer])
        except DomainError:
            # An unreachable destination frees its blocks when its death is processed.
            with contextlib.suppress(Unavailable):
                destination.free(list(fresh.values()))
            raise
        self.free([table.relocate(i, fresh[i]) for i in moving])
        return len(moving)

    def read(self, blocks: Sequence[BlockRef]) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole KV of ``blocks``, all on one holder, in every layer (DGFM's staged recall)."""
        holders = {self._holder(block) for block in blocks}
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
        return self._live(table, index)

    @staticmethod
    def _live(table: BlockTable, index: int) -> BlockRef:
        """Block ``index`` of ``table``, which must not be lost."""
        block = table[index]
        if isinstance(block, LostBlock):
            raise FailedPrecondition(
                f"block {index} was lost with creditor {block.creditor}; recompute it before using it"
            )
        return block

    @staticmethod
    def _holder(block: BlockRef) -> str | None:
        """None for a local block, else its creditor."""
        return None if isinstance(block, LocalBlock) else block.creditor

    def _allocator(self, holder: str | None) -> KvBlockAllocator:
        return self.local if holder is None else self._creditor(holder)

    def _creditor(self, creditor: str) -> RemoteBlockAllocator:
        allocator = self._creditors.get(creditor)
        if allocator is None:
            raise NotFound(f"worker {self.worker_id} is not connected to creditor {creditor}")
        return allocator
