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

Each commit costs etcd, the committing replica and every replica watching the catalog about the
same whatever it holds, so larger groups cost less a registration. A caller announces its item
while it is on its way (:meth:`GroupCommit.expect`: a registration from the moment it starts,
through its validation and blob staging, until it submits). The caller about to run a flush
first waits, at most ``linger_s``, until every item announced before it started waiting has been
submitted or withdrawn, so those join its batch instead of each starting the next one. Items
announced later are not waited for (a steady stream of uploads would otherwise hold every
batch for the whole ``linger_s``), and a lone caller, with nothing else on its way, never waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Self, TypeVar

T = TypeVar("T")

LINGER_S = 0.03
"""How long a flush waits at most for the items announced on their way before it. Two replicas
taking 16 uploads at once on 2 busy cores (load 4-7) waited 3 ms at the median and 13 ms at the
90th percentile for them; 10 ms cut 25% of the waits short, 30 ms 0.4%. Reached only when a
registration stalls before its commit (an etcd read, a collector's mark)."""


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


class Expected:
    """An item announced on its way to :meth:`GroupCommit.submit`: a context whose exit withdraws
    it if it was not submitted (its caller failed or was refused before its commit)."""

    def __init__(self, arrivals: _Arrivals, number: int):
        self._arrivals = arrivals
        self._number = number

    def arrived(self) -> None:
        """It is submitted (or withdrawn): no flush waits for it any more."""
        self._arrivals.arrive(self._number)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.arrived()


class _Arrivals:
    """The items announced and not yet submitted, oldest first, and the wait for them."""

    def __init__(self, linger_s: float, clock: Callable[[], float]):
        self._linger_s = linger_s
        self._clock = clock
        self._announced = 0
        """Items announced so far: the next one's number."""
        self._pending: dict[int, None] = {}
        """Numbers of the items on their way, in announcement order."""
        self._changed = threading.Condition(threading.Lock())

    def expect(self) -> Expected:
        with self._changed:
            number, self._announced = self._announced, self._announced + 1
            self._pending[number] = None
        return Expected(self, number)

    def arrive(self, number: int) -> None:
        with self._changed:
            if number not in self._pending:
                return  # arrived before
            oldest = next(iter(self._pending))
            del self._pending[number]
            if number == oldest:  # only then can a waiting flush's condition have changed
                self._changed.notify_all()

    def wait(self) -> None:
        """Until every item announced before now has arrived, or ``linger_s`` has passed."""
        if self._linger_s <= 0:
            return
        with self._changed:
            horizon = self._announced
            if not self._waits_for(horizon):
                return
            deadline = self._clock() + self._linger_s
            while self._waits_for(horizon):
                left = deadline - self._clock()
                if left <= 0:
                    return
                self._changed.wait(left)

    def _waits_for(self, horizon: int) -> bool:
        """An item announced before ``horizon`` is still on its way."""
        return bool(self._pending) and next(iter(self._pending)) < horizon

    @property
    def pending(self) -> int:
        with self._changed:
            return len(self._pending)


class GroupCommit(Generic[T]):
    """Batches calls of ``apply(items) -> one error or None per item``, in submission order, each
    batch after ``flush()`` (nothing by default); a flush that raises fails its batch. A flush
    waits up to ``linger_s`` for the items announced before it (:meth:`expect`); ``clock``
    (seconds) times that wait, injected by tests."""

    def __init__(
        self,
        apply: Callable[[Sequence[T]], Sequence[BaseException | None]],
        flush: Callable[[], None] = lambda: None,
        *,
        linger_s: float = LINGER_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._apply = apply
        self._flush = flush
        self._arrivals = _Arrivals(linger_s, clock)
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
    def on_their_way(self) -> int:
        """Items announced (:meth:`expect`) and neither submitted nor withdrawn yet."""
        return self._arrivals.pending

    @property
    def queued(self) -> int:
        """Items not committed yet, flushed or not."""
        with self._queue_lock:
            return len(self._queue) + sum(len(batch) for _, batch in self._flushed)

    def expect(self) -> Expected:
        """Announce an item on its way: flushes starting from now wait for it (up to
        ``linger_s``) until it is submitted with this, or withdrawn (the context's exit)."""
        return self._arrivals.expect()

    def submit(self, item: T, expected: Expected | None = None) -> None:
        """Commit ``item`` (with whatever else is queued); raises the error ``apply`` gave it.
        ``expected``: its announcement (:meth:`expect`), if it was announced."""
        ticket = _Ticket(item)
        with self._queue_lock:
            self._queue.append(ticket)
            lead, self._flushing = not self._flushing, True
        if expected is not None:  # after it is queued: a flush that sees it arrived takes it
            expected.arrived()
        if not lead:
            ticket.woken.wait()
        if not ticket.done:  # this caller flushes the next batch, then carries it to its commit
            self._arrivals.wait()
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
