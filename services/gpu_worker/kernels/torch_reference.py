"""The LoRA delta in plain torch: ground truth for every other backend and the CPU path.

Work is done per group of segments sharing an adapter (:class:`SegmentGroup`), so the number of
torch calls grows with the number of distinct adapters in the batch, not with tokens or segments.
An adapter's rows sit mostly back to back in its pages, so each run of adjacent rows is read
through a strided view of the pool (no index tensor, no copy); a lone row is one run of one.
Math is fp32 whatever the pool dtype (a CPU without native bf16 emulates 16-bit matmuls: a
32×64×1536 expand took 5.1 ms in bf16 and 0.14 ms in fp32 on the AVX2 machines), and ``out``
is rounded once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.gpu_worker.kernels.lora_segments import LoraSegments


def _shrink(x: torch.Tensor, pool: torch.Tensor, runs, width: int) -> torch.Tensor:
    """``x @ A^T`` (``x`` fp32) with A read run by run from the pool: fp32 ``[tokens, rank]``."""
    parts = [x @ pool[o : o + n * width].view(n, width).float().T for o, n in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _expand(h: torch.Tensor, pool: torch.Tensor, runs, width: int) -> torch.Tensor:
    """``h @ B^T`` with B^T read run by run from the pool: fp32 ``[tokens, width]``."""
    total, row = None, 0
    for o, n in runs:
        part = h[:, row : row + n] @ pool[o : o + n * width].view(n, width).float()
        total = part if total is None else total.add_(part)
        row += n
    return total


def lora_delta_torch(x: torch.Tensor, pool: torch.Tensor, seg: LoraSegments, out: torch.Tensor) -> None:
    """``out[t] += scales[s] * (x[t] @ A_s^T) @ B_s^T`` for every token of every segment with an
    adapter, in place; rows of rank-0 segments are not written."""
    for group in seg.groups:
        a_runs = group.rows.runs("a", seg.in_features)
        b_runs = group.rows.runs("b", seg.out_features)
        if len(group.token_ranges) == 1:
            # One contiguous run of tokens (the common case): views, no index tensors.
            start, end = group.token_ranges[0]
            h = _shrink(x[start:end].float(), pool, a_runs, seg.in_features).mul_(group.scale)
            # Adding fp32 into a half `out` in place computes in fp32 and rounds once.
            out[start:end].add_(_expand(h, pool, b_runs, seg.out_features))
        else:
            rows = torch.cat([torch.arange(s, e, device=x.device) for s, e in group.token_ranges])
            h = _shrink(x.index_select(0, rows).float(), pool, a_runs, seg.in_features)
            h.mul_(group.scale)
            updated = out.index_select(0, rows).float().add_(_expand(h, pool, b_runs, seg.out_features))
            out.index_copy_(0, rows, updated.to(out.dtype))


def stacked_lora_delta_torch(
    x: torch.Tensor, pool: torch.Tensor, segments: Sequence[LoraSegments], outs: Sequence[torch.Tensor]
) -> None:
    """The reference of the stacked kernels (``triton_stacked_lora``): the delta of
    ``segments[i]`` added into ``outs[i]``, for projections that all read ``x``."""
    for seg, out in zip(segments, outs, strict=True):
        lora_delta_torch(x, pool, seg, out)
