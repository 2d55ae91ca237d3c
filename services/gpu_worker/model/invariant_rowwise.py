"""RMSNorm (alone or after the residual add) and the SwiGLU activation for deterministic serving: each row computed alone.

torch's vector loops round their scalar tails differently (``F.silu`` calls ``std::exp`` there,
Sleef's exp in the vector body: 5% of fp32 values differ), and where a thread's tail falls depends
on the tensor's length and the thread count, i.e. on the batch. ``kernels/cpu_invariant_rowwise.c``
computes every element with the same vector code, rounding where HF's torch code rounds.
"""

from __future__ import annotations

import torch

from services.gpu_worker.kernels import cpu_invariant


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """LlamaRMSNorm of each row of ``x`` [T, hidden], in ``dtype`` (the compute dtype)."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    cpu_invariant.rms_norm(x, weight, eps, out)
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += delta`` in place (the residual add), then :func:`rms_norm` of the new ``x``."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    cpu_invariant.add_rms_norm(x, delta, weight, eps, out)
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (each [T, intermediate], one dtype and row stride)."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    cpu_invariant.silu_mul(gate, up, out)
    return out
