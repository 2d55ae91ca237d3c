"""A request's block table: local, remote and lost entries."""

from __future__ import annotations

import pytest

from services.gpu_worker.distkv.block_table import BlockTable, LocalBlock, LostBlock, RemoteBlock
from services.runtime.errors import FailedPrecondition


def test_blocks_needed_capacity_and_positions():
    table = BlockTable(4)
    assert table.blocks_needed(0) == 0 and table.blocks_needed(9) == 3
    table.append([LocalBlock((0, 1)), RemoteBlock("w1", 5)])
    assert table.capacity == 8 and table.blocks_needed(9) == 1 and table.blocks_needed(8) == 0
    assert table.first_position(1) == 4


def test_a_dead_creditors_blocks_become_lost_and_can_be_replaced():
    table = BlockTable(4)
    table.append([LocalBlock((0,)), RemoteBlock("w1", 5), RemoteBlock("w2", 0), RemoteBlock("w1", 6)])
    assert table.first_lost_position() is None
    assert table.mark_lost("w1") == [1, 3]
    assert table.mark_lost("w1") == []
    assert table[1] == LostBlock("w1", 5) and table.lost_indices() == [1, 3]
    assert table.first_lost_position() == 4
    with pytest.raises(FailedPrecondition, match="not lost"):
        table.replace(2, LocalBlock((9,)))
    table.replace(1, LocalBlock((7,)))
    assert table.lost_indices() == [3]
    entries = table.take_all()
    assert len(entries) == 4 and len(table) == 0
