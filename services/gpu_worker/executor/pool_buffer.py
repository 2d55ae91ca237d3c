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
