"""The requests of one step whose KV blocks are not all local (DistKV-LLM): their KV is written
and attended over through the rManager, wherever each block lives, one call per holder and
layer for all of them. The other requests keep the paged fast path."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.gpu_worker.memory.block_table import BlockTable
from services.gpu_worker.memory.rmanager import RManager, TableQueries


@dataclass(frozen=True)
class DistributedSpan:
    """One request's rows in the step's flattened tokens, and its block table."""

    token_start: int
    """First row of its new tokens."""
    token_end: int
    """End (exclusive) of its rows."""
    table: BlockTable
    """Where its KV blocks are."""
    positions: torch.Tensor
    """int64 [token_end - token_start]: the token positions of those rows."""


class DistributedKv:
    """Write-then-attend for the step's ``spans``, through ``rm``."""

    def __init__(self, rm: RManager, spans: list[DistributedSpan]):
        self.rm = rm
        self.spans = spans

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Store ``layer``'s keys ``k`` [T, kv_heads, head_dim] and values ``v`` [T, kv_dim] of the
        spans' rows, then fill their rows of ``out`` [T, heads * head_dim] with exact attention of
        ``q`` [T, heads, head_dim] over each request's whole context."""
        queries = []
        for span in self.spans:
            rows = slice(span.token_start, span.token_end)
            keys = k[rows].reshape(span.token_end - span.token_start, -1)
            self.rm.write(span.table, layer, span.positions, keys, v[rows])
            queries.append(TableQueries(span.table, q[rows], span.positions))
        for span, attended in zip(self.spans, self.rm.attend(layer, queries)):
            out[span.token_start : span.token_end] = attended.reshape(attended.shape[0], -1).to(out.dtype)
