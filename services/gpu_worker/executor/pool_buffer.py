"""An executor's pool buffer: the memory its pages live in, private or shared with this host."""

from __future__ import annotations

import torch

from services.gpu_worker.attention.pool_view import PoolLayout, PoolView
from services.gpu_worker.memory.shared_memory import shared_zeros


def pool_buffer(layout: PoolLayout, dtype: torch.dtype, device: torch.device | str, shared: bool) -> PoolView:
    """A zero-filled buffer of ``layout``'s pages. ``shared``: in a memfd (a CPU pool only), so
    that debtors on this host can map it (the shared-memory lending lane)."""
    if not shared:
        return PoolView.zeros(layout, dtype, device)
    if torch.device(device).type != "cpu":
        raise ValueError(f"only a CPU pool can be shared with other processes, not {device}")
    buffer, fd = shared_zeros(layout.num_pages * layout.page_elems, dtype, "loramesh-unified-pool")
    return PoolView(layout, dtype, buffer, shared_fd=fd)


def pool_with_spare_page(
    layout: PoolLayout, dtype: torch.dtype, device: torch.device | str
) -> tuple[PoolView, PoolView]:
    """A zero-filled buffer of ``layout``'s pages and one more past them: the view of the pages
    (what the engine allocates from) and the view of the whole buffer, whose last page takes the
    KV writes of a CUDA graph's padding rows (``decode_graphs.py``). Same memory, same offsets."""
    spare = PoolLayout(layout.num_pages + 1, layout.kv_block_tokens, layout.kv_dim, layout.num_layers)
    whole = PoolView.zeros(spare, dtype, device)
    return PoolView(layout, dtype, whole.buffer[: layout.num_pages * layout.page_elems]), whole


def spare_key_rows(layout: PoolLayout, device: torch.device | str) -> torch.Tensor:
    """int64 [kv_block_tokens]: the rows (in ``kv_rows``) of the spare page's key block."""
    first = 2 * layout.num_pages * layout.kv_block_tokens
    return torch.arange(first, first + layout.kv_block_tokens, dtype=torch.int64, device=device)
