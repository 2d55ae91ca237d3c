"""The one place the model asks for a LoRA delta; picks the backend.

``auto``: Triton on CUDA tensors (MBGMV when every segment is one token, else MBGMM); on the CPU
the native kernel (``cpu_native``) when it compiled, else the torch reference. The Triton module
is imported on first use, never at import of this module, so ``TRITON_INTERPRET=1`` set by a
test before that first use still applies to its kernels.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from services.gpu_worker.kernels.cpu_native import (
    lora_delta_cpu_native,
    lora_deltas_cpu_native,
    native_available,
)
from services.gpu_worker.kernels.lora_segments import LoraSegments
from services.gpu_worker.kernels.padded_bmm import lora_delta_padded_bmm
from services.gpu_worker.kernels.torch_reference import lora_delta_torch

BACKENDS = ("torch", "padded_bmm", "cpu_native", "triton")
"""Explicit backend names :func:`add_lora_delta` accepts besides ``auto``."""


def available_backends() -> tuple[str, ...]:
    """Backends that can run in this process: ``torch`` and ``padded_bmm`` always, ``cpu_native``
    when the C kernel compiled, ``triton`` with CUDA or with the Triton interpreter
    (``TRITON_INTERPRET=1``) on."""
    found = ["torch", "padded_bmm"]
    if native_available():
        found.append("cpu_native")
    if importlib.util.find_spec("triton") is not None:
        from triton import knobs

        if torch.cuda.is_available() or knobs.runtime.interpret:
            found.append("triton")
    return tuple(found)


def _resolve(backend: str, pool: torch.Tensor) -> str:
    if backend == "auto":
        return "triton" if pool.is_cuda else "cpu_native" if native_available() else "torch"
    return backend


def add_lora_deltas(
    x: torch.Tensor,
    pool: torch.Tensor,
    problems: Sequence[tuple[LoraSegments, torch.Tensor]],
    backend: str = "auto",
) -> None:
    """:func:`add_lora_delta` for several (segments, out) pairs that read the same ``x`` (q, k and v
    of one layer): the native CPU kernel serves them in one call, other backends one by one."""
    backend = _resolve(backend, pool)
    if backend == "cpu_native":
        lora_deltas_cpu_native(x, pool, problems)
    else:
        for seg, out in problems:
            add_lora_delta(x, pool, seg, out, backend)


def add_lora_delta(
    x: torch.Tensor, pool: torch.Tensor, seg: LoraSegments, out: torch.Tensor, backend: str = "auto"
) -> None:
    """``out[t] += scales[s] * (x[t] @ A_s^T) @ B_s^T`` for every token of every segment with an
    adapter, in place, with ``backend`` (``auto`` or one of :data:`BACKENDS`)."""
    backend = _resolve(backend, pool)
    if backend == "torch":
        lora_delta_torch(x, pool, seg, out)
    elif backend == "cpu_native":
        lora_delta_cpu_native(x, pool, seg, out)
    elif backend == "padded_bmm":
        lora_delta_padded_bmm(x, pool, seg, out)
    elif backend == "triton":
        from services.gpu_worker.kernels import triton_lora

        (triton_lora.mbgmv if seg.is_decode else triton_lora.mbgmm)(x, pool, seg, out)
    else:
        raise ValueError(f"unknown LoRA backend {backend!r}; expected 'auto' or one of {BACKENDS}")
