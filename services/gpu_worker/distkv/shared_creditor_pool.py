"""A same-host creditor's pool mapped into the debtor's process: the debtor writes its borrowed
blocks' K/V and attends over them in place, with no message per layer.

Why: on one host a borrowing decode step otherwise waits, every layer, for each creditor's
process to wake, compute and answer (20 of an 87 ms step measured, bench/HISTORY.md "Borrowed
KV at near-local speed"). With the pool mapped, attention over borrowed blocks costs what it
costs over local ones. The creditor still owns its pages: it allocates and frees them (the
lending RPCs), and tells the debtor which pages each of its blocks is (the lane's ``PAGES``
call, checked against the debtor's own loans); the debtor touches only those.

What it gives up: the creditor's compute cap does not apply (the debtor computes), and a
debtor process could read the whole mapped pool, so the creditor offers it only when mutual TLS
is off (where no call is authorized per identity anyway; ``lending_lane.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.gpu_worker.attention.dist_attention import PartialAttention
from services.gpu_worker.attention.pool_block_attention import attend_pool_blocks
from services.gpu_worker.attention.pool_view import PoolView
from services.gpu_worker.distkv.kv_block_allocator import AttendCall, KvRows
from services.runtime.errors import FailedPrecondition


class SharedCreditorPool:
    """``view`` over one creditor's shared pool and the pages of the blocks it lent us."""

    def __init__(self, creditor: str, view: PoolView):
        self.creditor = creditor
        self.view = view
        self._pages: dict[int, tuple[int, ...]] = {}

    def learn(self, block_ids: Sequence[int], pages: Sequence[tuple[int, ...]]) -> None:
        """The creditor lent ``block_ids``, block ``i`` on ``pages[i]`` (one page per layer)."""
        self._pages.update(zip(block_ids, pages, strict=True))

    def forget(self, block_ids: Sequence[int]) -> None:
        """``block_ids`` went back to the creditor."""
        for block_id in block_ids:
            self._pages.pop(block_id, None)

    def _layer_pages(self, layer: int, block_ids: Sequence[int]) -> list[int]:
        try:
            return [self._pages[block_id][layer] for block_id in block_ids]
        except KeyError as unknown:
            raise FailedPrecondition(
                f"block {unknown.args[0]} of creditor {self.creditor} is not lent to this worker"
            ) from None

    def write(self, layer: int, rows: KvRows[int]) -> None:
        self.view.write_kv(self._layer_pages(layer, rows.blocks), rows.slots, rows.keys, rows.values)

    def attend(self, call: AttendCall[int]) -> list[PartialAttention]:
        """The call's ``write`` stored, then each segment's partial attention over its blocks."""
        pages = [self._layer_pages(call.layer, segment.blocks) for segment in call.segments]
        if call.write is not None:
            self.write(call.layer, call.write)
        return [
            attend_pool_blocks(
                self.view,
                segment_pages,
                segment.block_first_positions,
                segment.queries,
                segment.query_positions,
            )
            for segment, segment_pages in zip(call.segments, pages, strict=True)
        ]
