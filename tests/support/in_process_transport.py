"""A :class:`CreditorTransport` that calls a creditor's ``BlockLender`` in the same process.

Test support: several workers in one process. Its calls are made at once:
what it returns as pending is already answered. ``kill`` stands for the
creditor's process dying: every later call fails as an unreachable creditor does over gRPC.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from services.gpu_worker.attention.dist_attention import PartialAttention
from services.gpu_worker.distkv.block_lender import BlockLender
from services.gpu_worker.distkv.kv_block_allocator import AttendCall, KvRows
from services.gpu_worker.distkv.remote_block_allocator import Pending, done
from services.runtime.errors import DomainError, Unavailable


class InProcessTransport:
    """The lending API of ``lender``, the creditor named ``creditor``."""

    def __init__(self, creditor: str, lender: BlockLender):
        self.creditor = creditor
        self.lender = lender
        self.alive = True

    def kill(self) -> None:
        self.alive = False

    def allocate(self, debtor: str, count: int) -> list[int]:
        return self._reachable().allocate(debtor, count)

    def write_async(self, debtor: str, layer: int, rows: KvRows[int]) -> Pending[None]:
        return done(lambda: self._reachable().write(debtor, layer, rows))

    def free(self, debtor: str, block_ids: Sequence[int]) -> None:
        self._reachable().free(debtor, block_ids)

    def attend(self, debtor: str, call: AttendCall[int]) -> Pending[list[PartialAttention]]:
        return done(lambda: self._reachable().attend(debtor, call))

    def read(self, debtor: str, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._reachable().read(debtor, block_ids)

    def release(self, debtor: str, block_ids: Sequence[int]) -> None:
        if not self.alive:
            return
        for block_id in block_ids:
            with contextlib.suppress(DomainError):  # not lent to it (any more): nothing to release
                self.lender.free(debtor, [block_id])

    def _reachable(self) -> BlockLender:
        if not self.alive:
            raise Unavailable(f"creditor {self.creditor} is unreachable")
        return self.lender
