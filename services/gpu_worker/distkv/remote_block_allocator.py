"""The debtor side of borrowing: KV blocks on one creditor, behind ``KvBlockAllocator``.

Calls go through a :class:`CreditorTransport`, the creditor's :class:`BlockLender` API as seen
from another worker: a gRPC client in production, an in-process one in tests. The allocator
remembers which blocks it holds there, so a free can be checked here first and, when the
creditor is declared dead, the blocks it held are known: forgotten here, and released there in
the background, for a creditor declared dead may live (a partition healed, or a process that came
back under the same id and lent some of them), and would otherwise keep them lent forever.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Protocol, TypeVar

import torch

from services.gpu_worker.attention.dist_attention import PartialAttention
from services.gpu_worker.distkv.block_table import RemoteBlock
from services.gpu_worker.distkv.kv_block_allocator import AttendCall, AttendSegment, KvRows
from services.runtime.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)


class CreditorUnavailable(Unavailable):
    """A creditor could not be reached: the debtor treats it as dead (its blocks are lost)."""

    def __init__(self, creditor: str, message: str):
        super().__init__(message)
        self.creditor = creditor


class CreditorRefused(ResourceExhausted):
    """A creditor refused to compute attention (over its lent-compute cap): it lives, and holds
    the blocks still; the debtor gives them back and recomputes the requests that had some."""

    def __init__(self, creditor: str, message: str):
        super().__init__(message)
        self.creditor = creditor


T_co = TypeVar("T_co", covariant=True)


class Pending(Protocol[T_co]):
    """A call on its way to a creditor: ``result()`` waits for its answer (or raises its error)."""

    def result(self) -> T_co: ...


def done(call: Callable[[], object]) -> Future:
    """``call()`` made now, as a :class:`Pending` (for transports that answer at once)."""
    future: Future = Future()
    try:
        future.set_result(call())
    except Exception as error:  # noqa: BLE001 -- handed to whoever waits for the result
        future.set_exception(error)
    return future


class CreditorTransport(Protocol):
    """One creditor's lending API (see ``BlockLender``), called on behalf of ``debtor``.

    Errors arrive as the creditor raised them (domain errors; a gRPC transport maps statuses
    back), and ``Unavailable`` when the creditor cannot be reached.
    """

    def allocate(self, debtor: str, count: int) -> list[int]: ...

    def write_async(self, debtor: str, layer: int, rows: KvRows[int]) -> Pending[None]:
        """Store ``rows`` (``BlockLender.write``), returning at once: a prefill ships its lent
        blocks' KV while it computes (``result()`` waits for a write that must be done)."""
        ...

    def free(self, debtor: str, block_ids: Sequence[int]) -> None: ...

    def attend(self, debtor: str, call: AttendCall[int]) -> Pending[list[PartialAttention]]:
        """Partial attention per segment, the call's ``write`` stored first; returns at once, so
        that the debtor attends over its local blocks while the creditor works."""
        ...

    def read(self, debtor: str, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def release(self, debtor: str, block_ids: Sequence[int]) -> None:
        """Free whichever of ``block_ids`` the creditor still lends ``debtor``, each on its own
        (a restarted creditor lends some and never lent the others), in the background: returns
        at once, and failures are only logged (a dead creditor holds nothing)."""
        ...


class RemoteBlockAllocator:
    """Blocks this worker (``debtor``) borrowed from ``creditor``."""

    def __init__(self, debtor: str, creditor: str, transport: CreditorTransport):
        if debtor == creditor:
            raise ValueError(f"worker {debtor} cannot borrow from itself")
        self.debtor = debtor
        self.creditor = creditor
        self.transport = transport
        self._held: set[int] = set()

    @property
    def held_blocks(self) -> int:
        return len(self._held)

    def allocate(self, count: int) -> list[RemoteBlock]:
        """Borrow ``count`` blocks (the creditor's refusal propagates: ``ResourceExhausted``)."""
        ids = self._reach(self.transport.allocate, self.debtor, count)
        self._held.update(ids)
        return [RemoteBlock(self.creditor, block_id) for block_id in ids]

    def write(self, layer: int, rows: KvRows[RemoteBlock]) -> None:
        self.write_async(layer, rows).result()

    def free(self, blocks: Sequence[RemoteBlock]) -> None:
        ids = self.wire_ids(blocks)
        if len(set(ids)) != len(ids):
            raise FailedPrecondition("the same remote block is freed twice in one call")
        self._reach(self.transport.free, self.debtor, ids)
        self._held.difference_update(ids)

    def write_async(self, layer: int, rows: KvRows[RemoteBlock]) -> Pending[None]:
        pending = self._reach(self.transport.write_async, self.debtor, layer, self._wire_rows(rows))
        return _Answer(lambda: self._reach(pending.result))

    def attend(self, layer: int, segments: Sequence[AttendSegment[RemoteBlock]]) -> list[PartialAttention]:
        wire = [
            AttendSegment(s.queries, s.query_positions, self.wire_ids(s.blocks), s.block_first_positions)
            for s in segments
        ]
        return self.attend_wire(layer, wire).result()

    def attend_wire(
        self,
        layer: int,
        segments: Sequence[AttendSegment[int]],
        write: KvRows[RemoteBlock] | None = None,
    ) -> Pending[list[PartialAttention]]:
        """Attention over ``segments``, whose blocks are named by :meth:`wire_ids`, and ``write``
        stored first, in one call; returns at once."""
        call = AttendCall(layer, segments, None if write is None else self._wire_rows(write))
        pending = self._reach(self.transport.attend, self.debtor, call)
        return _Answer(lambda: self._attended(pending))

    def read(self, blocks: Sequence[RemoteBlock]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._reach(self.transport.read, self.debtor, self.wire_ids(blocks))

    def creditor_lost(self) -> list[int]:
        """The creditor is declared dead: forget (and return) the ids of every block held there,
        and ask it to release them in case it lives."""
        lost, self._held = sorted(self._held), set()
        if lost:
            self.transport.release(self.debtor, lost)
        return lost

    def _reach(self, call, *args):
        """``call(*args)``; the creditor's unreachability names the creditor, and so does its not
        knowing a block we hold (``NotLent``: it restarted under the same id, or took its loans
        back when our lease expired in a partition; the KV is gone)."""
        try:
            return call(*args)
        except CreditorUnavailable:
            raise
        except (Unavailable, NotFound) as unreachable:
            raise CreditorUnavailable(self.creditor, unreachable.message) from unreachable

    def _attended(self, pending: Pending[list[PartialAttention]]) -> list[PartialAttention]:
        """The answer of an attention call; the creditor's refusal to compute it (its compute
        cap, ``LendComputeExhausted`` there) is ``CreditorRefused``."""
        try:
            return self._reach(pending.result)
        except CreditorRefused:
            raise
        except ResourceExhausted as refused:
            raise CreditorRefused(self.creditor, refused.message) from refused

    def _wire_rows(self, rows: KvRows[RemoteBlock]) -> KvRows[int]:
        return KvRows(self.wire_ids(rows.blocks), rows.slots, rows.keys, rows.values)

    def wire_ids(self, blocks: Sequence[RemoteBlock]) -> list[int]:
        """The creditor's ids of ``blocks``, each checked to be held there."""
        ids = []
        for block in blocks:
            if block.creditor != self.creditor:
                raise InvalidArgument(f"block {block} is not on creditor {self.creditor}")
            if block.block_id not in self._held:
                raise FailedPrecondition(
                    f"block {block.block_id} on {self.creditor} is not held (freed already?)"
                )
            ids.append(block.block_id)
        return ids


class _Answer:
    """A pending call whose ``result()`` is ``wait()``: the call's answer, its errors named."""

    def __init__(self, wait: Callable[[], object]):
        self.result = wait
