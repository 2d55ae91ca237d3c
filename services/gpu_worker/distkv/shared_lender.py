"""This worker's :class:`BlockLender` as several threads reach it.

Lending RPCs from other workers run on their own threads while the engine thread steps (never
queued onto the engine thread: two workers borrowing from each other would each wait for the
other's step). The engine thread itself reclaims the blocks of dead debtors, and heartbeats read
the loans. One lock serializes the lender's bookkeeping; the pool's pages have a lock of their
own (``UnifiedPool``), so a lender call never waits for a whole engine step.

Allocation also checks that the debtor's KV blocks have this pool's shape: a block is written
and attended over as ``kv_block_tokens`` rows of ``kv_dim`` per layer, which only means the same
thing on both sides for the same base model.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from services.gpu_worker.attention.dist_attention import PartialAttention
from services.gpu_worker.attention.pool_view import PoolLayout
from services.gpu_worker.distkv.block_lender import BlockLender
from services.gpu_worker.distkv.kv_block_allocator import AttendCall, KvRows
from services.runtime.errors import FailedPrecondition


class SharedLender:
    """Thread-safe front of ``lender``, whose pool has ``layout``."""

    def __init__(self, lender: BlockLender, layout: PoolLayout):
        self.lender = lender
        self.layout = layout
        self._lock = threading.Lock()

    @property
    def max_lent_blocks(self) -> int:
        return self.lender.config.max_lent_blocks

    def lent_to(self) -> dict[str, int]:
        with self._lock:
            return self.lender.lent_to()

    def allocate(self, debtor: str, count: int, debtor_layout: PoolLayout) -> list[int]:
        """Lend ``count`` blocks to ``debtor``, whose pool is laid out as ``debtor_layout``."""
        mine = self.layout
        if not mine.same_blocks(debtor_layout):
            raise FailedPrecondition(
                f"KV blocks differ: this worker's are {mine.kv_block_tokens} tokens × {mine.num_layers} "
                f"layers × kv_dim {mine.kv_dim}, {debtor}'s are {debtor_layout.kv_block_tokens} × "
                f"{debtor_layout.num_layers} × {debtor_layout.kv_dim} (same base model and "
                "--kv-block-tokens needed)"
            )
        with self._lock:
            return self.lender.allocate(debtor, count)

    def write(self, debtor: str, layer: int, rows: KvRows[int]) -> None:
        with self._lock:
            self.lender.write(debtor, layer, rows)

    def free(self, debtor: str, block_ids: Sequence[int]) -> None:
        with self._lock:
            self.lender.free(debtor, block_ids)

    def attend(self, debtor: str, call: AttendCall[int]) -> list[PartialAttention]:
        with self._lock:
            return self.lender.attend(debtor, call)

    def read(self, debtor: str, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            return self.lender.read(debtor, block_ids)

    def pages_of(self, debtor: str, block_ids: Sequence[int]) -> list[tuple[int, ...]]:
        with self._lock:
            return self.lender.pages_of(debtor, block_ids)

    def reclaim(self, debtor: str) -> int:
        """Free every block lent to ``debtor`` (its lease expired); how many."""
        with self._lock:
            return self.lender.reclaim(debtor)
