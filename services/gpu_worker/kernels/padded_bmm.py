"""S-LoRA's ``S-LoRA-bmm`` ablation baseline: pad, batch-matmul, scatter back.

Every segment's A and B^T are gathered zero-padded to ``max_rank`` and its tokens zero-padded to
the longest segment, then two ``torch.bmm`` calls do the work. Same result as the reference; the
padding is the cost the paper measures against the gather kernels (which never pad).
"""

from __future__ import annotations

import torch

from services.gpu_worker.kernels.lora_segments import LoraSegments


def lora_delta_padded_bmm(x: torch.Tensor, pool: torch.Tensor, seg: LoraSegments, out: torch.Tensor) -> None:
    """Same contract as :func:`~services.gpu_worker.kernels.torch_reference.lora_delta_torch`."""
    if seg.max_rank == 0 or seg.max_seg_len == 0:
        return
    device = pool.device
    # On a GPU the bmm runs in the pool dtype (tensor cores, fp32 accumulation inside cuBLAS), as
    # the baseline would; elsewhere fp32.
    compute = pool.dtype if pool.is_cuda else torch.float32
    seg_starts = seg.seg_starts.long()
    rank_starts = seg.rank_starts.long()
    ranks = rank_starts[1:] - rank_starts[:-1]
    lengths = seg_starts[1:] - seg_starts[:-1]

    j = torch.arange(seg.max_rank, device=device)
    rank_valid = j < ranks[:, None]  # [S, R]
    # Padding slots read some real row (clamped index) and are then zeroed with `where`, so a
    # NaN/inf elsewhere in the pool cannot leak in.
    row = (rank_starts[:-1, None] + j).clamp_max(seg.a_offsets.numel() - 1)
    a = _padded_gather(pool, seg.a_offsets[row], rank_valid, seg.in_features, compute)  # [S, R, in]
    b = _padded_gather(pool, seg.b_offsets[row], rank_valid, seg.out_features, compute)  # [S, R, out]

    t = torch.arange(seg.max_seg_len, device=device)
    token_valid = (t < lengths[:, None]) & (ranks[:, None] > 0)  # [S, L]
    token = (seg_starts[:-1, None] + t).clamp_max(x.shape[0] - 1)
    xs = torch.where(token_valid[..., None], x[token].to(compute), 0)  # [S, L, in]

    h = torch.bmm(xs, a.transpose(1, 2)) * seg.scales[:, None, None].to(compute)  # [S, L, R]
    delta = torch.bmm(h, b)  # [S, L, out]
    rows = token[token_valid]
    out.index_copy_(0, rows, (out[rows].float() + delta[token_valid].float()).to(out.dtype))


def _padded_gather(
    pool: torch.Tensor, offsets: torch.Tensor, valid: torch.Tensor, width: int, dtype: torch.dtype
) -> torch.Tensor:
    """``[S, R, width]`` rows of the pool at ``offsets[S, R]``, zero where ``valid`` is False."""
    rows = pool[offsets[..., None] + torch.arange(width, device=pool.device)].to(dtype)
    return torch.where(valid[..., None], rows, 0)
