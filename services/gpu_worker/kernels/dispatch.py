"""The one place the model asks for a LoRA delta; picks the backend.

``auto``: Triton on CUDA tensors (MBGMV when every segment is one token, else MBGMM), the torch
reference elsewhere. The Triton module is imported on first use, never at import of this module,
so ``TRITON_INTERPRET=1`` set by a test before that first use still applies to its kernels.
"""

from __future__ import annotations

import importlib.util

import torch

from services.gpu_worker.kernels.lora_segments import LoraSegments
from services.gpu_worker.kernels.padded_bmm import lora_delta_padded_bmm
from services.gpu_worker.kernels.torch_reference import lora_delta_torch

BACKENDS = ("torch", "padded_bmm", "triton")
"""Explicit backend names :func:`add_lora_delta` accepts besides ``auto``."""


def available_backends() -> tuple[str, ...]:
    """Backends that can run in this process: ``torch`` and ``padded_bmm`` always, ``triton`` with
    CUDA or with the Triton interpreter (``TRITON_INTERPRET=1``) on."""
    if importlib.util.find_spec("triton") is None:
        return BACKENDS[:2]
    from triton import knobs

    return BACKENDS if torch.cuda.is_available() or knobs.runtime.interpret else BACKENDS[:2]


def add_lora_delta(
    x: torch.Tensor, pool: torch.Tensor, seg: LoraSegments, out: torch.Tensor, backend: str = "auto"
) -> None:
    """``out[t] += scales[s] * (x[t] @ A_s^T) @ B_s^T`` for every token of every segment with an
    adapter, in place, with ``backend`` (``auto`` or one of :data:`BACKENDS`)."""
    if backend == "auto":
        backend = "triton" if pool.is_cuda else "torch"
    if backend == "torch":
        lora_delta_torch(x, pool, seg, out)
    elif backend == "padded_bmm":
        lora_delta_padded_bmm(x, pool, seg, out)
    elif backend == "triton":
        from services.gpu_worker.kernels import triton_lora

        (triton_lora.mbgmv if seg.is_decode else triton_lora.mbgmm)(x, pool, seg, out)
    else:
        raise ValueError(f"unknown LoRA backend {backend!r}; expected 'auto' or one of {BACKENDS}")
