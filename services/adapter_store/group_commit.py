"""Group commit: one caller commits the work every waiting caller queued, in one go.

Each registration must end in a durable directory entry (an ``fsync`` of the blob directory)
and a durable catalog row (an etcd transaction, an ``fsync`` of etcd's WAL). Done one
registration at a time, those two flushes cost more than the bytes. Here each caller queues its
item; the first finding no batch running runs one (everything queued so far, in one flush of
each) while the others wait. When a batch ends, each of its callers is woken alone, and the
oldest caller still queued is woken to run the next batch: a caller whose item is committed
never waits behind the next batch, nor do the waiting callers take a lock one after another
just to learn that. A caller returns only once its own item is durable, so an acknowledged
registration survives a crash exactly as before; a lone caller pays what it did.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class _Ticket(Generic[T]):
    item: T
    done: bool = False
    error: BaseException | None = None
    woken: threading.Event = field(default_factory=threading.Event)
    """Set when its batch has run (``done``), or when it is to run the next batch."""


class GroupCommit(Generic[T]):
    """Batches calls of ``apply(items) -> one error or None per item``, in submission order."""

    def __init__(self, apply: Callable[[Sequence[T]], Sequence[BaseException | None]]):
        self._apply = apply
        self._queue: list[_Ticket[T]] = []
        self._queue_lock = threading.Lock()
        self._running = False
        """A batch is running, or its next leader has been woken (guarded by the queue lock)."""
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
            lead, self._running = not self._running, True
        if not lead:
            ticket.woken.wait()
        if not ticket.done:  # this caller runs the next batch
            with self._queue_lock:
                batch, self._queue = self._queue, []
            try:
                self._run(batch)
            finally:
                self._hand_over()
        if ticket.error is not None:
            raise ticket.error

    def _hand_over(self) -> None:
        """Wake the oldest caller queued to run the next batch, or let the next one run it."""
        with self._queue_lock:
            following = self._queue[0] if self._queue else None
            self._running = following is not None
        if following is not None:
            following.woken.set()

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
                ticket.woken.set()
