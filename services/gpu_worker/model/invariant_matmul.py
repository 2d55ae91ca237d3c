"""The base model's matmuls for deterministic serving: each output row independent of the batch.

:class:`~services.gpu_worker.model.base_matmul.BaseMatmul` hands ``x`` to the BLAS library, which
picks its kernel by shape: on an AVX2 EPYC, MKL computes a one-row ``F.linear`` as a GEMV and
rounds it differently from the same row in a two-row batch; oneDNN on AVX-512/AMX CPUs switches
blockings and ISAs with M. Padding every call to one fixed row-tile shape would keep MKL but
pay for the padding and for re-reading the weights per tile (measured here: a one-row matmul
2-3x slower with tiles of 8 to 32 rows). Instead each output is one dot product in one fixed
order (``kernels/cpu_invariant_matmul.c``): the cost follows the rows that exist, and the
weights are read in their storage dtype (no fp32 scratch copy of bf16 weights).
"""

from __future__ import annotations

import torch

from services.gpu_worker.kernels import cpu_invariant
from services.gpu_worker.model.quantized_weight import QuantizedWeight


class InvariantMatmul:
    """``x @ W^T (+ b)`` in ``compute_dtype``, each row computed alone."""

    def __init__(self, compute_dtype: torch.dtype):
        self.compute_dtype = compute_dtype

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for ``x`` [T, in] in the compute dtype."""
        if isinstance(weight, QuantizedWeight):  # its kernel keeps the same contract
            return weight.linear(x, bias, self.compute_dtype)
        out = torch.empty(x.shape[0], weight.shape[0], dtype=self.compute_dtype, device=x.device)
        cpu_invariant.linear(x, weight, bias, out)
        return out
