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

A batch goes through two stages, each run by one batch at a time: ``flush`` (the blob tier's
durability, started only after every item of the batch was queued) and ``apply`` (the catalog's
commit). They overlap between batches: while one batch's rows commit, the next batch's blobs are
flushed, so a batch waits for the longer of the two instead of their sum; an item is applied
only after its own batch's flush returned. Batches flushed while a commit runs are applied
together after it, in one go. The caller that ran a batch's flush carries it into the commit
stage: the other callers of the batch wait only once, until their item is committed.
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
    """Set when its batch has run (``done``), or when it is to run the next batch's flush."""
    commit_turn: threading.Event = field(default_factory=threading.Event)
    """For a caller that ran its batch's flush: set when its batch has run (``done``), or when it
    is to run the next commit."""


class GroupCommit(Generic[T]):
    """Batches calls of ``apply(items) -> one error or None per item``, in submission order, each
    batch after ``flush()`` (nothing by default); a flush that raises fails its batch."""

    def __init__(
        self,
        apply: Callable[[Sequence[T]], Sequence[BaseException | None]],
        flush: Callable[[], None] = lambda: None,
    ):
        self._apply = apply
        self._flush = flush
        self._queue: list[_Ticket[T]] = []
        """Items waiting for the next flush."""
        self._flushed: list[tuple[_Ticket[T], list[_Ticket[T]]]] = []
        """Batches flushed, waiting for the next commit: each with the ticket of the caller that
        carries it."""
        self._queue_lock = threading.Lock()
        """Guards both queues and both stages' flags (held only to move tickets)."""
        self._flushing = False
        """A flush is running, or its next runner has been woken."""
        self._committing = False
        """A commit is running, or its next runner has been woken."""
        self.batches = 0
        """How many commits ran (each one etcd round trip, or one per chunk sent at once)."""

    @property
    def queued(self) -> int:
        """Items not committed yet, flushed or not."""
        with self._queue_lock:
            return len(self._queue) + sum(len(batch) for _, batch in self._flushed)

    def submit(self, item: T) -> None:
        """Commit ``item`` (with whatever else is queued); raises the error ``apply`` gave it."""
        ticket = _Ticket(item)
        with self._queue_lock:
            self._queue.append(ticket)
            lead, self._flushing = not self._flushing, True
        if not lead:
            ticket.woken.wait()
        if not ticket.done:  # this caller flushes the next batch, then carries it to its commit
            with self._queue_lock:
                batch, self._queue = self._queue, []
            try:
                flushed = self._run_flush(batch)
            finally:
                self._hand_over_flush()
            if flushed:
                self._commit(ticket, batch)
        if ticket.error is not None:
            raise ticket.error

    def _run_flush(self, batch: list[_Ticket[T]]) -> bool:
        """Flush for ``batch``; False (each of its callers woken with the error) when it failed."""
        try:
            self._flush()
        except Exception as error:  # noqa: BLE001 - the whole batch failed: each caller gets the error
            self._finish(batch, [error] * len(batch))
            return False
        except BaseException:  # interrupted (SystemExit...): no caller may take it as flushed
            self._finish(batch, [RuntimeError("the flush was interrupted")] * len(batch))
            raise
        return True

    def _hand_over_flush(self) -> None:
        """Wake the oldest caller queued to flush the next batch, or let the next one do it."""
        with self._queue_lock:
            following = self._queue[0] if self._queue else None
            self._flushing = following is not None
        if following is not None:
            following.woken.set()

    def _commit(self, carrier: _Ticket[T], batch: list[_Ticket[T]]) -> None:
        """Commit the flushed ``batch``, with the batches flushed meanwhile, or leave it to the
        commit running now (whose runner wakes this caller if it is to run the next one)."""
        with self._queue_lock:
            self._flushed.append((carrier, batch))
            lead, self._committing = not self._committing, True
        if not lead:
            carrier.commit_turn.wait()
        if carrier.done:
            return
        with self._queue_lock:
            group = [ticket for _, queued in self._flushed for ticket in queued]
            self._flushed = []
        try:
            self._run(group)
        finally:
            with self._queue_lock:
                following = self._flushed[0][0] if self._flushed else None
                self._committing = following is not None
            if following is not None:
                following.commit_turn.set()

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
            self._finish(batch, errors)

    @staticmethod
    def _finish(batch: list[_Ticket[T]], errors: Sequence[BaseException | None]) -> None:
        for ticket, error in zip(batch, errors, strict=True):
            ticket.error, ticket.done = error, True
            ticket.woken.set()
            ticket.commit_turn.set()
