"""Group commit: one caller commits the work every waiting caller queued, in one go.

Each registration must end in a durable directory entry (an ``fsync`` of the blob directory)
and a durable catalog row (a SQLite commit, an ``fsync`` of its WAL). Done one registration at a
time, those two flushes cost more than the bytes. Here each caller queues its item and then
either finds it committed by the batch another caller ran, or runs the batch itself: everything
queued so far, in one flush of each. A caller returns only once its own item is durable, so an
acknowledged registration survives a crash exactly as before; a lone caller pays what it did.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class _Ticket(Generic[T]):
    item: T
    done: bool = False
    error: BaseException | None = None


class GroupCommit(Generic[T]):
    """Batches calls of ``apply(items) -> one error or None per item``, in submission order."""

    def __init__(self, apply: Callable[[Sequence[T]], Sequence[BaseException | None]]):
        self._apply = apply
        self._queue: list[_Ticket[T]] = []
        self._queue_lock = threading.Lock()
        self._leader = threading.Lock()
        self.batches = 0
        """How many batches ran (each one flush of each kind)."""

    @property
    def queued(self) -> int:
        """Items waiting for the next batch."""
        with self._queue_lock:
            return len(self._queue)

    def submit(self, item: T) -> None:
        """Commit ``item`` (with whatever else is queued); raises the error ``apply`` gave it."""
        ticket = _Ticket(item)
        with self._queue_lock:
            self._queue.append(ticket)
        with self._leader:  # while a batch runs, the next one queues up behind it
            if not ticket.done:
                with self._queue_lock:
                    batch, self._queue = self._queue, []
                self._run(batch)
        if ticket.error is not None:
            raise ticket.error

    def _run(self, batch: list[_Ticket[T]]) -> None:
        self.batches += 1
        errors: Sequence[BaseException | None] | None = None
        try:
            errors = self._apply([t.item for t in batch])
        except Exception as error:  # noqa: BLE001 - the whole batch failed: each caller gets the error
            errors = [error] * len(batch)
        finally:
            if errors is None:  # interrupted (SystemExit...): no caller may take it as committed
                errors = [RuntimeError("the commit was interrupted")] * len(batch)
            for ticket, error in zip(batch, errors, strict=True):
                ticket.error, ticket.done = error, True
