"""The base model's matmuls in the compute dtype, with weights kept in their storage dtype.

Quantized weights (``QuantizedWeight``) go to their own kernel, which reads the blocks as they are.

When the two differ (bf16 weights on a CPU without bf16 GEMM units, see ``compute_dtype``), each
weight is widened into one reusable scratch buffer right before its matmul, so memory holds the
16-bit weights plus one layer's largest matrix in fp32, never an fp32 copy of the model. A weight
larger than the scratch (the vocabulary projection) is widened and multiplied in row chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.gpu_worker.model.quantized_weight import QuantizedWeight


class BaseMatmul:
    """``x @ W^T (+ b)`` with ``x`` in the compute dtype and ``W`` in any storage dtype."""

    def __init__(self, compute_dtype: torch.dtype, scratch_elems: int, device: torch.device):
        self.compute_dtype = compute_dtype
        self._scratch = torch.empty(scratch_elems, dtype=compute_dtype, device=device)
        """Widened copy of the weight in use; its size bounds the rows of one chunk."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` computed in the compute dtype."""
        if bias is not None:
            bias = bias.to(self.compute_dtype)
        if isinstance(weight, QuantizedWeight):
            return weight.linear(x, bias, self.compute_dtype)
        if weight.dtype == self.compute_dtype:
            return F.linear(x, weight, bias)
        rows, cols = weight.shape
        if weight.numel() <= self._scratch.numel():
            wide = self._scratch[: weight.numel()].view(rows, cols)
            wide.copy_(weight)
            return F.linear(x, wide, bias)
        chunk = self._scratch.numel() // cols
        out = torch.empty(*x.shape[:-1], rows, dtype=self.compute_dtype, device=x.device)
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            wide = self._scratch[: (end - start) * cols].view(end - start, cols)
            wide.copy_(weight[start:end])
            out[..., start:end] = F.linear(x, wide, None if bias is None else bias[start:end])
        return out
