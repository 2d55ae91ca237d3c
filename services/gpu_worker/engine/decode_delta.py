"""A decode step that only continues the last one, as what changed: the contract's short form.

A decode batch changes little from one step to the next: every request adds one token, one in
sixteen adds a KV block, few join or leave. When a step's requests are the very requests of the
last plain decode step, in the same rows, each one position further, the engine hands its
executor a :class:`DecodeDelta` instead of a whole :class:`~services.gpu_worker.engine.step_plan.StepPlan`:
the new tokens and the few rows whose block table or adapter slot changed. The executor's
persistent batch (``executor/persistent_batch.py``) applies it; an executor that holds no such
batch declines it and gets the plan.

:class:`DecodeEncoder` finds a delta from a step's columns (ids, positions, tables, slots) with
whole-list operations that run in C (``map``, list equality, which takes the same object as
equal without calling its ``__eq__``): no Python bytecode per steady request. The engine's
tables (``KvCache.frozen_blocks``) and adapter slots (``AdapterPager.slot``) are the same objects
until they change, so only the rows that did are looked at one by one. The engine runs one over
its requests, the executor one over the plans it is handed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import compress, count
from operator import is_not, ne

from services.gpu_worker.engine.step_plan import AdapterSlot

_next = (1).__add__


@dataclass(frozen=True)
class DecodeDelta:
    """A plain decode step of the very requests of the last decode step, in the same rows, each
    one token further: what changed is listed, the steady rows are not named at all. Requests
    joining or leaving, a row whose position does not follow on, anything but one new token per
    row: a full plan."""

    token_ids: Sequence[int]
    """Each row's new token, in row order (the tokens sampled from the last step's logits)."""
    grown: tuple[tuple[int, tuple[tuple[int, ...], ...]], ...] = ()
    """``(row, kv_blocks)`` of each row whose table changed: its whole new table (blocks
    appended to the one it had are written alone; any other change rewrites the row)."""
    readapted: tuple[tuple[int, AdapterSlot | None], ...] = ()
    """``(row, adapter)`` of each row whose adapter slot changed."""
    lora_backend: str = "auto"
    batch_invariant: bool = False
    request_ids: Sequence[str] = ()
    """The rows' request ids, in row order: the receiver checks they are the rows it holds (the
    same list object as the sender's last one, where it can, so the check is one comparison)."""


@dataclass(frozen=True)
class DecodeColumns:
    """One plain decode step, column by column, in row order."""

    request_ids: list[str]
    start_positions: list[int]
    kv_blocks: list[tuple[tuple[int, ...], ...]]
    adapters: list[AdapterSlot | None]
    activated: bool
    """Some row is an activated LoRA's (its adapter applies from a position on): never a delta."""


class DecodeEncoder:
    """Remembers the last plain decode step's columns and turns the next into a
    :class:`DecodeDelta` when it continues it."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        """The last step's request ids (empty: no step to continue)."""
        self._next_starts: list[int] = []
        self._tables: list = []
        self._adapters: list = []

    def forget(self) -> None:
        """The last step was not a plain decode step: the next is a full plan."""
        self.ids = []

    def encode(
        self,
        step: DecodeColumns,
        tokens: Callable[[], Sequence[int]],
        lora_backend: str,
        batch_invariant: bool,
    ) -> DecodeDelta | None:
        """``step`` as a delta on the last step, with the new tokens ``tokens()`` gives (asked
        only for a delta); None when it is not one (rows joined, left or moved, a position
        jumped, an activated LoRA's row). Either way ``step`` becomes the last step."""
        ids, starts, tables, adapters = step.request_ids, step.start_positions, step.kv_blocks, step.adapters
        follows = ids == self.ids and starts == self._next_starts and not step.activated
        if follows:
            ids = self.ids  # the same list object on both sides: the receiver's check is one comparison
        held_tables, held_adapters = self._tables, self._adapters
        self.ids, self._tables, self._adapters = ids, tables, adapters
        self._next_starts = list(map(_next, starts))
        if not follows:
            return None
        grown = ()
        if tables != held_tables:  # C: the same objects compare equal at once
            rows = compress(count(), map(is_not, tables, held_tables))
            grown = tuple((row, tables[row]) for row in rows)
        readapted = ()
        if adapters != held_adapters:
            rows = compress(count(), map(ne, adapters, held_adapters))
            readapted = tuple((row, adapters[row]) for row in rows)
        return DecodeDelta(tokens(), grown, readapted, lora_backend, batch_invariant, ids)

    def continued(self, delta: DecodeDelta) -> bool:
        """Take ``delta`` (made by another encoder) as the next step when its rows are this
        encoder's last ones; False, nothing taken, when they are not."""
        if not self.ids or delta.request_ids != self.ids:
            return False
        self._next_starts = list(map(_next, self._next_starts))
        if delta.grown:
            self._tables = list(self._tables)
            for row, table in delta.grown:
                self._tables[row] = table
        if delta.readapted:
            self._adapters = list(self._adapters)
            for row, slot in delta.readapted:
                self._adapters[row] = slot
        return True
