"""A decode batch kept between steps: each request's row and block table in device buffers.

The engine hands its executor a whole :class:`StepPlan` every step. A decode batch changes little
from one step to the next: every request adds one token, one in sixteen adds a KV block, few join
or leave. :class:`PersistentBatch` keeps each running request's row and ``[blocks, layers]`` page
table in one device tensor (vLLM v1's ``InputBatch``) and writes only what changed: the rows of
requests that joined, the blocks appended to a table, and, when requests join or leave, one
gather that moves the kept rows to their new places. A step's host work is then a few list
passes over the plan (ids, table objects, tokens, positions: C loops, no tensor per request) and
a fixed number of tensor operations, whatever the batch.

Rows follow the plan's order (the order of the logits the engine samples from). Table entries
past a request's own blocks hold page 0, as the padded tables of the step builder do: real
memory, never attended (masked).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import torch

from services.gpu_worker.attention.pool_view import PoolLayout
from services.gpu_worker.engine.step_plan import PlannedRequest
from services.gpu_worker.model.step_batch import DecodeGroup

_ids = attrgetter("request_id")
_tables = attrgetter("kv_blocks")
_starts = attrgetter("start_position")
_tokens = attrgetter("token_ids")


def is_plain_decode(requests: tuple[PlannedRequest, ...]) -> bool:
    """Whether every request adds exactly one token with its KV in this pool (no prefill, no
    drafts to verify, nothing borrowed): the steps a persistent batch serves."""
    return (
        bool(requests)
        and all(len(t) == 1 for t in map(_tokens, requests))
        and not any(r.borrowed for r in requests)
    )


class PersistentBatch:
    """The rows and block tables of the last decode step, updated in place."""

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
        self._aranges: dict[int, torch.Tensor] = {}
        self._group: _Group | None = None
        """The last step's decode group, patched in place while its rows and width hold."""
        self.writes = 0
        """Rows written (joined, moved or given new blocks) since start: what the host work follows."""

    def update(self, requests: tuple[PlannedRequest, ...]) -> bool:
        """Make the rows those of ``requests`` (a :func:`is_plain_decode` plan). True when requests
        joined or left or the order changed (the rows moved), False when only tables grew."""
        ids = list(map(_ids, requests))
        tables = list(map(_tables, requests))
        if ids == self.ids:
            stale = [i for i, (new, old) in enumerate(zip(tables, self._held)) if new is not old]
            if stale:
                self._write(tables, stale, self._held)
            return False
        self._group = None  # rows moved: its columns are other requests'
        self._reorder(ids, tables)
        return True

    def _reorder(self, ids: list[str], tables: list) -> None:
        index = {request_id: row for row, request_id in enumerate(self.ids)}
        sources = [index.get(request_id, -1) for request_id in ids]
        self._reserve(len(ids), max(map(len, tables)))
        kept = [(row, source) for row, source in enumerate(sources) if source >= 0]
        if kept and any(row != source for row, source in kept):
            rows, origins = zip(*kept)
            device = self.device
            # Indexing copies, so the moved rows are read before any is overwritten.
            moved = self.tables[torch.tensor(origins, device=device)]
            self.tables[torch.tensor(rows, device=device)] = moved
        held = [self._held[source] if source >= 0 else None for source in sources]
        stale = [row for row, (new, old) in enumerate(zip(tables, held)) if new is not old]
        self.ids = ids
        if stale:
            self._write(tables, stale, held)
        else:
            self._held = held

    def _write(self, tables: list, rows: list[int], held: list) -> None:
        """Write ``tables[row]`` for ``rows``: only the appended blocks where the held table is
        still its prefix, the whole row (zeros after it) otherwise."""
        self._reserve(len(tables), max(len(tables[row]) for row in rows))
        whole, cells, blocks = [], [], []
        for row in rows:
            new, old = tables[row], held[row]
            first = len(old) if old is not None and len(new) >= len(old) and new[: len(old)] == old else 0
            if first == 0:
                whole.append(row)
            cells.extend((row, b) for b in range(first, len(new)))
            blocks.extend(new[first:])
        device = self.device
        if whole:
            self.tables[torch.tensor(whole, device=device)] = 0
            self._group = None
        if cells:
            at = torch.tensor(cells, dtype=torch.int64, device=device)
            pages = torch.tensor(blocks, dtype=torch.int64, device=device)
            self.tables[at[:, 0], at[:, 1]] = pages
            group = self._group
            if group is not None and max(b for _, b in cells) < group.width:
                # Appended blocks inside the group's width: its columns patched, not rebuilt.
                columns = at[:, 0] * group.width + at[:, 1]
                group.key_blocks[:, columns] = 2 * pages.T
                group.value_blocks[:, columns] = 2 * pages.T + 1
            else:
                self._group = None
        self.writes += len(rows)
        held = list(held)
        for row in rows:
            held[row] = tables[row]
        self._held = held

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

    def arange(self, n: int) -> torch.Tensor:
        """int64 ``[0, n)`` on the device (kept: token rows, logits rows)."""
        cached = self._aranges.get(n)
        if cached is None:
            cached = self._aranges[n] = torch.arange(n, dtype=torch.int64, device=self.device)
        return cached

    def step_inputs(
        self, requests: tuple[PlannedRequest, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeGroup]:
        """The step's token ids, positions, key write rows ``[L, n]`` and decode group, from the
        rows :meth:`update` made (what the step builder computes for a plain decode plan)."""
        device, block = self.device, self.block
        starts = list(map(_starts, requests))
        n = len(starts)
        token_ids = torch.tensor([t[0] for t in map(_tokens, requests)], dtype=torch.int64, device=device)
        position = torch.tensor(starts, dtype=torch.int64, device=device)
        rows = self.arange(n)
        pages = self.tables[rows, position // block]  # [n, L]
        write_keys = (pages * (2 * block) + (position % block)[:, None]).T.contiguous()
        num_blocks = -(-(max(starts) + 1) // block)
        group = self._group
        if group is None or group.rows != n or group.width != num_blocks:
            key_blocks = (2 * self.tables[:n, :num_blocks]).permute(2, 0, 1).reshape(self.layers, -1)
            mask = torch.arange(num_blocks * block, device=device)[None, :] <= position[:, None]
            group = self._group = _Group(n, num_blocks, key_blocks, key_blocks + 1, mask, starts)
        elif starts != group.next_starts:
            torch.le(group.span(device)[None, :], position[:, None], out=group.mask)
            group.starts = starts
        else:
            group.mask[rows, position] = True  # each row one position further
            group.starts = starts
        decode = DecodeGroup(
            token_rows=rows,
            key_blocks=group.key_blocks,
            value_blocks=group.value_blocks,
            mask=group.mask[:, None, None, :],
        )
        return token_ids, position, write_keys, decode


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
    starts: list[int]
    """The positions the mask was made for."""

    @property
    def next_starts(self) -> list[int]:
        return [s + 1 for s in self.starts]

    def span(self, device: torch.device) -> torch.Tensor:
        return torch.arange(self.mask.shape[1], device=device)
