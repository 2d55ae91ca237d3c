"""Micro-attention over KV blocks held in this worker's unified pool.

This is what a creditor runs on a query a debtor sent it (over the blocks it holds for that
debtor), and what a worker runs over its own local blocks: the same function, because a lent
block is an ordinary KV page of the creditor's pool. It reads only the pages it is given.

On a CPU with the batch-invariant kernels it computes block by block (``chunked_attention``),
whatever the debtor's mode: a deterministic debtor asks for one block per segment and combines the
partials itself, and gets the bits its own local pass would have computed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.gpu_worker.attention.chunked_attention import attend_blocks
from services.gpu_worker.attention.dist_attention import PartialAttention, micro_attention
from services.gpu_worker.attention.pool_view import PoolView
from services.gpu_worker.kernels.cpu_invariant import invariant_available


def attend_pool_blocks(
    pool: PoolView,
    pages: Sequence[int] | torch.Tensor,
    block_first_positions: Sequence[int] | torch.Tensor,
    queries: torch.Tensor,
    query_positions: torch.Tensor,
) -> PartialAttention:
    """Partial attention of ``queries`` [n, num_heads, head_dim] at ``query_positions`` [n] over
    the KV pages ``pages`` of one layer, page ``i`` holding the tokens at positions
    ``block_first_positions[i] ..`` ``+ kv_block_tokens − 1``.

    Slots not yet written sit at positions past the request's last token, hence past every
    query, so the causal mask hides them: no fill count is needed.
    """
    if len(pages) != len(block_first_positions):
        raise ValueError(f"{len(pages)} pages but {len(block_first_positions)} block positions")
    block = pool.layout.kv_block_tokens
    head_dim = queries.shape[-1]
    if pool.device.type == "cpu" and head_dim % 8 == 0 and invariant_available():
        return attend_blocks(pool, pages, block_first_positions, queries, query_positions)
    num_kv_heads = pool.layout.kv_dim // head_dim
    device = pool.device
    page_ids = torch.as_tensor(pages, dtype=torch.int64, device=device)
    # The pool as blocks of kv_block_tokens rows: page p holds key block 2p and value block 2p + 1.
    blocks = pool.buffer.view(-1, block * pool.layout.kv_dim)
    keys = blocks.index_select(0, 2 * page_ids).view(-1, num_kv_heads, head_dim)
    values = blocks.index_select(0, 2 * page_ids + 1).view(-1, num_kv_heads, head_dim)
    firsts = torch.as_tensor(block_first_positions, dtype=torch.int64, device=device)
    key_positions = (firsts[:, None] + torch.arange(block, device=device)[None, :]).reshape(-1)
    return micro_attention(queries, keys, values, query_positions.to(device), key_positions)
