"""A request's KV block table (DistKV-LLM's logical→physical rBlock mapping, §4.3).

Logical block ``b`` holds the KV of token positions ``b*B .. b*B + B − 1`` in every layer
(``B`` = ``kv_block_tokens``). Each entry says where that block lives: in this worker's pool
(:class:`LocalBlock`), on a creditor (:class:`RemoteBlock`), or nowhere any more
(:class:`LostBlock`: its creditor died, so its tokens must be recomputed).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from services.runtime.errors import FailedPrecondition


@dataclass(frozen=True)
class LocalBlock:
    """A block in this worker's unified pool."""

    pages: tuple[int, ...]
    """One KV page per layer: ``pages[layer]`` holds that layer's keys and values."""


@dataclass(frozen=True)
class RemoteBlock:
    """A block lent to this worker by a creditor."""

    creditor: str
    """Worker id of the creditor holding it."""
    block_id: int
    """The creditor's id for it (meaningful only to that creditor)."""


@dataclass(frozen=True)
class LostBlock:
    """A remote block whose creditor died: its KV is gone."""

    creditor: str
    """The dead creditor."""
    block_id: int
    """Its id there, kept for logs."""


BlockRef = LocalBlock | RemoteBlock
"""A block that holds KV: where to write it and attend over it."""


class BlockTable:
    """The logical KV blocks of one request, in token order."""

    def __init__(self, block_tokens: int):
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.block_tokens = block_tokens
        self._entries: list[BlockRef | LostBlock] = []

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index: int) -> BlockRef | LostBlock:
        return self._entries[index]

    def __iter__(self) -> Iterator[BlockRef | LostBlock]:
        return iter(self._entries)

    @property
    def capacity(self) -> int:
        """Tokens the table can hold."""
        return len(self._entries) * self.block_tokens

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks to append so that ``num_tokens`` tokens fit."""
        return max(0, -(-num_tokens // self.block_tokens) - len(self._entries))

    def first_position(self, index: int) -> int:
        """Token position of the first slot of logical block ``index``."""
        return index * self.block_tokens

    def append(self, blocks: Sequence[BlockRef]) -> None:
        self._entries.extend(blocks)

    def replace(self, index: int, block: BlockRef) -> None:
        """Put a fresh block where a lost one was (its tokens are then recomputed into it)."""
        if not isinstance(self._entries[index], LostBlock):
            raise FailedPrecondition(f"block {index} is {self._entries[index]}, not lost: free it first")
        self._entries[index] = block

    def relocate(self, index: int, block: BlockRef) -> BlockRef:
        """Point block ``index`` at ``block``, which holds a copy of its KV; returns the old block
        (for the caller to free)."""
        old = self._entries[index]
        if isinstance(old, LostBlock):
            raise FailedPrecondition(
                f"block {index} was lost with {old.creditor}: recompute it, it cannot move"
            )
        self._entries[index] = block
        return old

    def mark_lost(self, creditor: str) -> list[int]:
        """Mark every block held by ``creditor`` lost; returns their logical indices."""
        lost = []
        for index, entry in enumerate(self._entries):
            if isinstance(entry, RemoteBlock) and entry.creditor == creditor:
                self._entries[index] = LostBlock(entry.creditor, entry.block_id)
                lost.append(index)
        return lost

    def lost_indices(self) -> list[int]:
        return [i for i, entry in enumerate(self._entries) if isinstance(entry, LostBlock)]

    def first_lost_position(self) -> int | None:
        """Position of the first token whose KV is lost (the request is valid before it), or None."""
        lost = self.lost_indices()
        return self.first_position(lost[0]) if lost else None

    def take_all(self) -> list[BlockRef | LostBlock]:
        """Empty the table, returning its entries (for the caller to free)."""
        entries, self._entries = self._entries, []
        return entries
