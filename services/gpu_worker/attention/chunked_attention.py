"""Attention split at KV block boundaries and combined along a fixed tree: a query gets the same
bits whether it is prefilled or decoded, alone or in a batch of 64, with its KV blocks in this
pool or lent by other workers (deterministic serving).

A query's attention over its context is the DistAttention combine (``dist_attention``) of one
partial per KV block, ``kv_block_tokens`` keys each: the block's own softmax output and
log-sum-exp. The partials are combined pairwise along the binary tree over the logical block index
(the tree over the next power of two, the missing right blocks being the exact identity), so the
result depends only on the query, its position and its context, never on how the blocks or the
queries were grouped into calls. Every piece runs in ``kernels/cpu_invariant_attention.c``:

- the local path (:func:`attend_locally`): one pass per query over its pool pages, computing the
  block partials and folding them into the tree as it goes: what every step runs for the requests
  whose KV is in this pool, prefill and decode alike;
- the split path, for a request with borrowed blocks: each block's partial computed where the
  block is (:func:`attend_blocks` on a one-block segment, what a creditor runs), the partials
  combined in block order on the debtor (:func:`combine_in_block_order`): the same two functions
  the local pass runs, so the same bits.

SDPA, the default path, gives neither guarantee: its kernel and blocking follow the shapes, and a
decode step pads every request's context to the longest one's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.gpu_worker.attention.dist_attention import PartialAttention
from services.gpu_worker.attention.pool_view import PoolView
from services.gpu_worker.kernels import cpu_invariant
from services.gpu_worker.model.step_batch import StepBatch


@dataclass(frozen=True)
class LocalQueries:
    """Queries of one step whose KV is in this pool, with their block tables (a decode group, or
    the tokens of one prefill)."""

    rows: torch.Tensor
    """int64 [n]: their rows in the step's flattened tokens."""
    table_of_row: torch.Tensor
    """int64 [n]: which of ``tables`` each one reads."""
    tables: torch.Tensor
    """int64 [layers, S, N]: per layer, key block ids of each table's context blocks (the pool
    viewed as blocks of ``kv_block_tokens`` rows; the value block is the next one)."""


def local_queries(batch: StepBatch) -> list[LocalQueries]:
    """The step's local queries, built once per step for every layer."""
    groups = []
    if batch.decode is not None:
        decode = batch.decode
        requests = decode.token_rows.numel()
        layers = decode.key_blocks.shape[0]
        groups.append(
            LocalQueries(
                decode.token_rows,
                torch.arange(requests, device=decode.token_rows.device),
                decode.key_blocks.reshape(layers, requests, -1).contiguous(),
            )
        )
    for span in batch.prefills:
        device = span.key_blocks.device
        groups.append(
            LocalQueries(
                torch.arange(span.token_start, span.token_end, device=device),
                torch.zeros(span.token_end - span.token_start, dtype=torch.int64, device=device),
                span.key_blocks.unsqueeze(1).contiguous(),
            )
        )
    return groups


def attend_locally(
    q: torch.Tensor,
    groups: Sequence[LocalQueries],
    positions: torch.Tensor,
    layer: int,
    pool: PoolView,
    num_kv_heads: int,
) -> torch.Tensor:
    """Attention of the ``groups``' rows of ``q`` [T, heads, head_dim] (at ``positions`` [T]) over
    their context in ``layer``: [T, heads * head_dim] in ``q``'s dtype; rows of no group are left
    unwritten (the remote requests' rows, filled by the rManager)."""
    tokens, heads, head_dim = q.shape
    flat = q.reshape(tokens, heads * head_dim)
    out = torch.empty_like(flat)
    for group in groups:
        cpu_invariant.prepare_attention(
            flat, out, pool.buffer, num_kv_heads, head_dim, pool.layout.kv_block_tokens,
            group.rows, positions, group.tables[layer], group.table_of_row,
        ).run()  # fmt: skip
    return out


def attend_blocks(
    pool: PoolView,
    pages: Sequence[int] | torch.Tensor,
    block_first_positions: Sequence[int] | torch.Tensor,
    queries: torch.Tensor,
    query_positions: torch.Tensor,
) -> PartialAttention:
    """Partial attention of ``queries`` [n, heads, head_dim] at ``query_positions`` [n] over the
    KV pages ``pages`` of one layer (page ``i`` holding the tokens from
    ``block_first_positions[i]`` on): the block partials combined in the order given. Over one
    page, exactly the block partial the local pass computes."""
    head_dim = queries.shape[-1]
    page_ids = torch.as_tensor(pages, dtype=torch.int64)
    outputs, lse = cpu_invariant.block_partials(
        queries.contiguous(), query_positions.to(torch.int64).contiguous(), pool.buffer, 2 * page_ids,
        torch.as_tensor(block_first_positions, dtype=torch.int64).contiguous(), pool.layout.kv_dim // head_dim,
        pool.layout.kv_block_tokens,
    )  # fmt: skip
    output, total = cpu_invariant.combine_partials(outputs, lse)
    return PartialAttention(output=output, lse=total)


def combine_in_block_order(block_partials: Sequence[PartialAttention]) -> PartialAttention:
    """The partial over a whole context from the partials of its blocks, ``block_partials[b]``
    being logical block ``b``'s (each [n, heads, head_dim] / [n, heads])."""
    outputs = torch.stack([p.output for p in block_partials], dim=1)
    lse = torch.stack([p.lse for p in block_partials], dim=1)
    output, total = cpu_invariant.combine_partials(outputs, lse)
    return PartialAttention(output=output, lse=total)
