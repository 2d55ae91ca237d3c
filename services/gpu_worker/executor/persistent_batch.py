"""A decode batch kept between steps: each request's row, position and block table in device buffers.

The engine hands its executor a whole :class:`StepPlan` every step. A decode batch changes little
from one step to the next: every request adds one token, one in sixteen adds a KV block, few join
or leave. :class:`PersistentBatch` keeps each running request's row, position and ``[blocks,
layers]`` page table in device tensors (vLLM v1's ``InputBatch``) and writes only what changed:
the rows of requests that joined, the blocks appended to a table, and, when requests join or
leave, one gather that moves the kept rows to their new places.

Two ways in: :meth:`update` takes a full plan (rows joined, left or moved; positions read from
it), :meth:`advance` a steady step (:class:`~services.gpu_worker.executor.plan_delta.DecodeDelta`:
the same rows, each one position further, on the device, and the few rows that grew a block).
Either way :meth:`step_inputs` then makes the step's tensors with a fixed number of tensor
operations, whatever the batch, none of them reading a tensor back to the host.

Rows follow the plan's order (the order of the logits the engine samples from). Table entries
past a request's own blocks hold page 0, as the padded tables of the step builder do: real
memory, never attended (masked).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from operator import add, attrgetter, eq, getitem, itemgetter, mul

import torch

from services.gpu_worker.attention.pool_view import PoolLayout
from services.gpu_worker.engine.step_plan import PlannedRequest
from services.gpu_worker.model.step_batch import DecodeGroup

_ids = attrgetter("request_id")
_tables = attrgetter("kv_blocks")
_starts = attrgetter("start_position")
_tokens = attrgetter("token_ids")
_borrowed = attrgetter("borrowed")
_row, _table = itemgetter(0), itemgetter(1)
_next = (1).__add__


def is_plain_decode(requests: tuple[PlannedRequest, ...]) -> bool:
    """Whether every request adds exactly one token with its KV in this pool (no prefill, no
    drafts to verify, nothing borrowed): the steps a persistent batch serves. Whole-list passes
    in C, no Python bytecode per request."""
    return (
        bool(requests) and set(map(len, map(_tokens, requests))) == {1} and not any(map(_borrowed, requests))
    )


def host_ints(values: Iterable[int], device: torch.device) -> torch.Tensor:
    """int64 ``values`` (flat) on ``device``: packed on the host by one C loop (``array``; a tensor
    from a Python list parses each element generically, ~10x slower), then one copy: the one
    conversion a GPU needs too."""
    packed = array("q", values)
    if not packed:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.frombuffer(packed, dtype=torch.int64).to(device, non_blocking=True)


class PersistentBatch:
    """The rows, positions and block tables of the last decode step, updated in place."""

    def __init__(self, layout: PoolLayout, device: torch.device | str):
        self.block = layout.kv_block_tokens
        self.layers = layout.num_layers
        self.device = torch.device(device)
        self.ids: list[str] = []
        """Request id of each row, in the last plan's order."""
        self._held: list[tuple[tuple[int, ...], ...]] = []
        """The ``kv_blocks`` object each row's table was written from (compared by identity)."""
        self.tables = torch.zeros(0, 0, self.layers, dtype=torch.int64, device=self.device)
        """int64 [row capacity, block capacity, layers]: each row's page ids, page 0 past its blocks."""
        self.positions = torch.zeros(0, dtype=torch.int64, device=self.device)
        """int64 [rows]: each row's position of this step's token."""
        self._last_start = 0
        """The largest of :attr:`positions` (host): the decode group's width follows it."""
        self._jumped = True
        """Positions came from a plan (not each one further): the mask is recomputed."""
        self._aranges: dict[int, torch.Tensor] = {}
        self._group: _Group | None = None
        """The last step's decode group, patched in place while its rows and width hold."""
        self._true = torch.ones((), dtype=torch.bool, device=self.device)
        self.writes = 0
        """Rows written (joined, moved or given new blocks) since start: what the host work follows."""

    def update(self, requests: tuple[PlannedRequest, ...]) -> bool:
        """Make the rows those of ``requests`` (a :func:`is_plain_decode` plan), positions
        included. True when requests joined or left or the order changed (the rows moved), False
        when only tables grew."""
        ids = list(map(_ids, requests))
        tables = list(map(_tables, requests))
        starts = list(map(_starts, requests))
        self.positions = host_ints(starts, self.device)
        self._last_start, self._jumped = max(starts), True
        if ids == self.ids:
            if tables != self._held:
                stale = [i for i, (new, old) in enumerate(zip(tables, self._held)) if new is not old]
                self._write(dict(zip(stale, map(tables.__getitem__, stale))))
            return False
        self._group = None  # rows moved: its columns are other requests'
        self._reorder(ids, tables)
        return True

    def advance(self, grown: Sequence[tuple[int, tuple[tuple[int, ...], ...]]]) -> None:
        """The same rows one position further; ``grown``: ``(row, kv_blocks)`` of the rows whose
        table changed (:attr:`DecodeDelta.grown`)."""
        self.positions = self.positions + 1
        self._last_start += 1
        self._jumped = False
        if grown and not self._append(grown):
            self._write(dict(grown))

    def _append(self, grown: Sequence[tuple[int, tuple[tuple[int, ...], ...]]]) -> bool:
        """The usual growth, each row one block past the table it had, written with whole-list
        passes in C (no Python bytecode per row); False, nothing written, for any other change."""
        held, capacity, layers = self._held, self.tables.shape[1], self.layers
        rows, news = list(map(_row, grown)), list(map(_table, grown))
        olds = list(map(held.__getitem__, rows))
        if None in olds:
            return False
        firsts = list(map(len, olds))
        if list(map(len, news)) != list(map(_next, firsts)) or news and max(firsts) >= capacity:
            return False
        if not all(map(eq, map(getitem, news, map(slice, firsts)), olds)):
            return False
        group, count = self._group, len(rows)
        cells = map(add, map(mul, rows, repeat(capacity)), firsts)
        patch = group is not None and max(firsts) < group.width
        columns = map(add, map(mul, rows, repeat(group.width)), firsts) if patch else ()
        # One copy to the device: table cells, the group's columns, then the page ids.
        packed = host_ints(
            chain(cells, columns, chain.from_iterable(map(getitem, news, firsts))), self.device
        )
        pages = packed[(2 if patch else 1) * count :].view(count, layers)
        self.tables.view(-1, layers).index_copy_(0, packed[:count], pages)
        if patch:
            keys = pages.T * 2
            group.key_blocks.index_copy_(1, packed[count : 2 * count], keys)
            group.value_blocks.index_copy_(1, packed[count : 2 * count], keys + 1)
        else:
            self._group = None
        list(map(held.__setitem__, rows, news))
        self.writes += count
        return True

    def _reorder(self, ids: list[str], tables: list) -> None:
        index = {request_id: row for row, request_id in enumerate(self.ids)}
        sources = [index.get(request_id, -1) for request_id in ids]
        self._reserve(len(ids), max(map(len, tables)))
        kept = [(row, source) for row, source in enumerate(sources) if source >= 0]
        if kept and any(row != source for row, source in kept):
            rows, origins = zip(*kept)
            # index_select copies, so the moved rows are read before any is overwritten.
            moved = self.tables.index_select(0, host_ints(origins, self.device))
            self.tables.index_copy_(0, host_ints(rows, self.device), moved)
        held = [self._held[source] if source >= 0 else None for source in sources]
        self.ids, self._held = ids, held
        stale = [row for row, (new, old) in enumerate(zip(tables, held)) if new is not old]
        if stale:
            self._write({row: tables[row] for row in stale})

    def _write(self, tables: dict[int, tuple[tuple[int, ...], ...]]) -> None:
        """Write each ``tables[row]``: only the appended blocks where the held table is still its
        prefix, the whole row (zeros after it) otherwise."""
        self._reserve(len(self.ids), max(map(len, tables.values())))
        held, capacity = self._held, self.tables.shape[1]
        group = self._group
        width = 0 if group is None else group.width
        whole, cells, columns, blocks = [], [], [], []
        for row, new in tables.items():
            old = held[row]
            first = len(old) if old is not None and len(new) >= len(old) and new[: len(old)] == old else 0
            if first == 0:
                whole.append(row)
            cells.extend(range(row * capacity + first, row * capacity + len(new)))
            if len(new) > width:
                width = 0  # a block past the group's width: the group is rebuilt
            columns.extend(range(row * width + first, row * width + len(new)))
            blocks.extend(new[first:])
            held[row] = new
        device = self.device
        if whole:
            self.tables.index_fill_(0, host_ints(whole, device), 0)
            group = self._group = None
        if blocks:
            # One copy to the device: table cells, the group's columns, then the page ids.
            count = len(cells)
            packed = host_ints(chain(cells, columns, chain.from_iterable(blocks)), device)
            pages = packed[2 * count :].view(count, self.layers)
            self.tables.view(-1, self.layers).index_copy_(0, packed[:count], pages)
            if group is not None and width:
                # Appended blocks inside the group's width: its columns patched, not rebuilt.
                keys = pages.T * 2
                group.key_blocks.index_copy_(1, packed[count : 2 * count], keys)
                group.value_blocks.index_copy_(1, packed[count : 2 * count], keys + 1)
            else:
                self._group = None
        self.writes += len(tables)

    def _reserve(self, rows: int, blocks: int) -> None:
        """Grow the tables (doubling) to hold ``rows`` rows of ``blocks`` blocks."""
        have_rows, have_blocks, layers = self.tables.shape
        if rows <= have_rows and blocks <= have_blocks:
            return
        grown = torch.zeros(
            max(rows, 2 * have_rows),
            max(blocks, 2 * have_blocks),
            layers,
            dtype=torch.int64,
            device=self.device,
        )
        grown[:have_rows, :have_blocks] = self.tables
        self.tables = grown
        self._group = None

    def arange(self, n: int) -> torch.Tensor:
        """int64 ``[0, n)`` on the device (kept: token rows, logits rows)."""
        cached = self._aranges.get(n)
        if cached is None:
            cached = self._aranges[n] = torch.arange(n, dtype=torch.int64, device=self.device)
        return cached

    def step_inputs(
        self, token_ids: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeGroup]:
        """The step's token ids (``token_ids`` on the device), positions, key write rows ``[L,
        n]`` and decode group, from the rows :meth:`update` or :meth:`advance` made (what the
        step builder computes for a plain decode plan)."""
        device, block = self.device, self.block
        position = self.positions
        n = position.shape[0]
        rows = self.arange(n)
        width = self.tables.shape[1]
        # Each row's page ids at its position: one gather over the flattened [rows x blocks] table.
        at = torch.div(position, block, rounding_mode="floor").add_(rows, alpha=width)
        pages = self.tables.view(-1, self.layers).index_select(0, at)  # [n, L]
        write_keys = (pages * (2 * block) + (position % block)[:, None]).T.contiguous()
        num_blocks = -(-(self._last_start + 1) // block)
        group = self._group
        if group is None or group.rows != n or group.width != num_blocks:
            key_blocks = (2 * self.tables[:n, :num_blocks]).permute(2, 0, 1).reshape(self.layers, -1)
            mask = torch.arange(num_blocks * block, device=device)[None, :] <= position[:, None]
            group = self._group = _Group(n, num_blocks, key_blocks, key_blocks + 1, mask)
        elif self._jumped:
            torch.le(group.span(device)[None, :], position[:, None], out=group.mask)
        else:
            group.mask.index_put_((rows, position), self._true)  # each row one position further
        decode = DecodeGroup(
            token_rows=rows,
            key_blocks=group.key_blocks,
            value_blocks=group.value_blocks,
            mask=group.mask[:, None, None, :],
        )
        return host_ints(token_ids, device), position, write_keys, decode


@dataclass
class _Group:
    """A decode group's tensors, kept from step to step: rebuilt when rows move or the context's
    width (blocks) changes, else patched: appended blocks' columns, and each row's next position
    in the mask."""

    rows: int
    width: int
    """Blocks per row (the longest context's)."""
    key_blocks: torch.Tensor
    """int64 [L, rows * width]."""
    value_blocks: torch.Tensor
    mask: torch.Tensor
    """bool [rows, width * kv_block_tokens]."""

    def span(self, device: torch.device) -> torch.Tensor:
        return torch.arange(self.mask.shape[1], device=device)
