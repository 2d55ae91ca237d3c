"""The LoRA delta in plain torch: ground truth for every other backend and the CPU path.

Work is done per group of segments sharing an adapter (:class:`SegmentGroup`), so the number of
torch calls grows with the number of distinct adapters in the batch, not with tokens or segments.
An adapter's rows sit mostly back to back in its pages, so each run of adjacent rows is read
through a strided view of the pool (no index tensor, no copy); a lone row is one run of one.
Math is fp32 for fp32 pools; with a 16-bit pool the matmuls run in that dtype with fp32
accumulation (what the CPU's bf16 units do), and ``out`` is rounded once.
"""

from __future__ import annotations

import torch

from services.gpu_worker.kernels.lora_segments import LoraSegments


def _shrink(x: torch.Tensor, pool: torch.Tensor, runs, width: int, compute: torch.dtype) -> torch.Tensor:
    """``x @ A^T`` with A read run by run from the pool: fp32 ``[tokens, rank]``."""
    parts = [x @ pool[o : o + n * width].view(n, width).to(compute).T for o, n in runs]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).float()


def _expand(h: torch.Tensor, pool: torch.Tensor, runs, width: int, compute: torch.dtype) -> torch.Tensor:
    """``h @ B^T`` with B^T read run by run from the pool: fp32 ``[tokens, width]``."""
    total, row = None, 0
    for o, n in runs:
        part = h[:, row : row + n].to(compute) @ pool[o : o + n * width].view(n, width).to(compute)
        total = part.float() if total is None else total.add_(part)
        row += n
    return total


def lora_delta_torch(x: torch.Tensor, pool: torch.Tensor, seg: LoraSegments, out: torch.Tensor) -> None:
    """``out[t] += scales[s] * (x[t] @ A_s^T) @ B_s^T`` for every token of every segment with an
    adapter, in place; rows of rank-0 segments are not written."""
    compute = torch.float32 if pool.dtype == torch.float32 else pool.dtype
    for group in seg.groups:
        a_runs = group.rows.runs("a", seg.in_features)
        b_runs = group.rows.runs("b", seg.out_features)
        if len(group.token_ranges) == 1:
            # One contiguous run of tokens (the common case): views, no index tensors.
            start, end = group.token_ranges[0]
            h = _shrink(x[start:end].to(compute), pool, a_runs, seg.in_features, compute).mul_(group.scale)
            # Adding fp32 into a half `out` in place computes in fp32 and rounds once.
            out[start:end].add_(_expand(h, pool, b_runs, seg.out_features, compute))
        else:
            rows = torch.cat([torch.arange(s, e, device=x.device) for s, e in group.token_ranges])
            h = _shrink(x.index_select(0, rows).to(compute), pool, a_runs, seg.in_features, compute)
            h.mul_(group.scale)
            updated = (
                out.index_select(0, rows).float().add_(_expand(h, pool, b_runs, seg.out_features, compute))
            )
            out.index_copy_(0, rows, updated.to(out.dtype))
