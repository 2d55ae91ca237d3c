"""The one interface through which KV blocks are allocated, written, freed and attended over,
whether they live in this worker's pool or on a creditor (DistKV-LLM's rManager API, §4.3).

Attention is part of the interface because a remote block is not read back to attend over it:
the query goes to where the block is and a :class:`PartialAttention` comes back (DistAttention,
§4.2). Blocks are read whole only to move them elsewhere (DGFM, §4.5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from services.gpu_worker.attention.dist_attention import PartialAttention

BlockT = TypeVar("BlockT")


@dataclass(frozen=True)
class AttendSegment(Generic[BlockT]):
    """The queries of one request and the blocks of its context one holder has."""

    queries: torch.Tensor
    """[n, num_heads, head_dim]: one layer's rotated queries of the request's new tokens."""
    query_positions: torch.Tensor
    """int64 [n]: their token positions (causal: a query sees keys at positions ≤ its own)."""
    blocks: Sequence[BlockT]
    """The blocks to attend over, as the holder names them."""
    block_first_positions: Sequence[int]
    """Token position of the first slot of each of ``blocks``."""


@dataclass(frozen=True)
class KvRows(Generic[BlockT]):
    """KV rows to store: token ``i``'s ``keys[i]`` and ``values[i]`` at slot ``slots[i]`` of
    ``blocks[i]``."""

    blocks: Sequence[BlockT]
    slots: torch.Tensor
    """int64 [n]: slots within the blocks."""
    keys: torch.Tensor
    """[n, kv_dim]."""
    values: torch.Tensor
    """[n, kv_dim]."""


@dataclass(frozen=True)
class AttendCall(Generic[BlockT]):
    """One layer's attention over one holder's blocks, for several requests in one call."""

    layer: int
    """The layer attended over (and written)."""
    segments: Sequence[AttendSegment[BlockT]]
    """Per request, its queries and the blocks of its context on this holder."""
    write: KvRows[BlockT] | None = None
    """The requests' new KV rows on this holder, stored before attending (None: nothing to store)."""


class KvBlockAllocator(Protocol[BlockT]):
    """KV blocks of one holder (this worker's pool, or one creditor), as seen by a debtor."""

    def allocate(self, count: int) -> list[BlockT]:
        """``count`` blocks, all or none (each holds ``kv_block_tokens`` tokens in every layer)."""
        ...

    def write(self, layer: int, rows: KvRows[BlockT]) -> None:
        """Store ``rows`` of ``layer``: token ``i``'s ``keys[i]`` and ``values[i]`` ([n, kv_dim])
        at slot ``slots[i]`` of ``blocks[i]``."""
        ...

    def free(self, blocks: Sequence[BlockT]) -> None:
        """Give ``blocks`` back, all or none (a block not held is an error, nothing is freed)."""
        ...

    def attend(self, layer: int, segments: Sequence[AttendSegment[BlockT]]) -> list[PartialAttention]:
        """Per segment, the partial attention of its queries over its blocks in ``layer``."""
        ...

    def read(self, blocks: Sequence[BlockT]) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole of ``blocks`` in every layer, to move them (DGFM's recall and swap): keys and
        values [num_layers, len(blocks) * kv_block_tokens, kv_dim] in the storage dtype."""
        ...
