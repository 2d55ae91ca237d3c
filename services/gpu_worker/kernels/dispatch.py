"""The one place the model asks for a LoRA delta; picks the backend.

``auto``: Triton on CUDA tensors (MBGMV when every segment is one token, else MBGMM); on the CPU
the native kernel (``cpu_native``) when it compiled, else the torch reference. The Triton module
is imported on first use, never at import of this module, so ``TRITON_INTERPRET=1`` set by a
test before that first use still applies to its kernels.

The model goes through :class:`StepLora`, one per batch, which resolves the backend and prepares
each of its calls once and reuses them step after step.

``batch_invariant`` (deterministic serving): a token's delta must not depend on the rest of its
batch. ``cpu_native`` then runs every group in one fixed order and ``triton`` runs MBGMV with one
program per token and fixed rank blocks for every batch; ``torch`` and ``padded_bmm`` hand the
work to library matmuls whose kernel depends on the shapes, so they refuse it.
"""

from __future__ import annotations

import torch

from services.gpu_worker.kernels.cpu_native import NativeCall, lora_delta_cpu_native, native_available
from services.gpu_worker.kernels.lora_segments import LoraSegments, share_input
from services.gpu_worker.kernels.padded_bmm import lora_delta_padded_bmm
from services.gpu_worker.kernels.torch_reference import lora_delta_torch

BACKENDS = ("torch", "padded_bmm", "cpu_native", "triton")
"""Explicit backend names :func:`add_lora_delta` accepts besides ``auto``."""
BATCH_INVARIANT_BACKENDS = ("cpu_native", "triton")
"""Backends whose deltas can be batch-invariant."""


def resolve_backend(backend: str, pool: torch.Tensor, batch_invariant: bool = False) -> str:
    """The backend ``backend`` (``auto`` or one of :data:`BACKENDS`) names for ``pool``'s device;
    ValueError when ``batch_invariant`` is asked of one that cannot be."""
    if backend == "auto":
        backend = "triton" if pool.is_cuda else "cpu_native" if native_available() else "torch"
    if batch_invariant and backend not in BATCH_INVARIANT_BACKENDS:
        raise ValueError(
            f"LoRA backend {backend!r} is not batch-invariant; deterministic serving needs one of "
            f"{BATCH_INVARIANT_BACKENDS} (on a CPU: a working C compiler for cpu_native)"
        )
    return backend


class StepLora:
    """One batch's LoRA work: per layer, the segments of each projection an adapter targets, and
    the model's calls on them, each prepared once.

    The step builder hands the model the same ``StepLora`` while the batch's adapters and token
    counts stay the same, so from the second decode step on a call finds its kernel arguments
    ready (for ``cpu_native`` a :class:`~services.gpu_worker.kernels.cpu_native.NativeCall`):
    a decode step makes 4 calls per layer, and their Python cost was a quarter of the adapters'
    extra step time at k = 8 on a 2-core CPU."""

    def __init__(self, layers: list[dict[str, LoraSegments]]):
        self.layers = layers
        """Per layer, the segments by projection name (projections no adapter targets absent)."""
        self._prepared: dict[tuple[int, tuple[str, ...], str], _PreparedCall] = {}

    def add_deltas(
        self,
        layer: int,
        names: tuple[str, ...],
        x: torch.Tensor,
        outs: tuple[torch.Tensor, ...],
        pool: torch.Tensor,
        backend: str = "auto",
        batch_invariant: bool = False,
    ) -> None:
        """Add the delta of projection ``names[i]`` of ``layer`` into ``outs[i]``, for projections
        that all read ``x`` (q, k and v of one layer: the native kernel serves them in one call)."""
        key = (layer, names, backend, batch_invariant)
        prepared = self._prepared.get(key)
        if prepared is None:
            per_module = self.layers[layer]
            segments = tuple(per_module.get(name) for name in names)
            prepared = self._prepared[key] = _PreparedCall(
                segments, resolve_backend(backend, pool, batch_invariant), batch_invariant
            )
        prepared.run(x, outs, pool)


class _PreparedCall:
    """The segments of one model call (None where no adapter targets the projection) and how to
    run them: one native call, or one delta per projection with another backend."""

    def __init__(self, segments: tuple[LoraSegments | None, ...], backend: str, batch_invariant: bool):
        self.segments = segments
        self.backend = backend
        self.batch_invariant = batch_invariant
        self.native = None
        if backend == "cpu_native" and any(seg is not None for seg in segments):
            self.native = NativeCall(segments, batch_invariant)
        self.stacked = backend == "triton" and _stackable(segments)
        """One stacked shrink + expand launch pair for all the call's projections."""

    def run(self, x: torch.Tensor, outs: tuple[torch.Tensor, ...], pool: torch.Tensor) -> None:
        if self.native is not None:
            self.native.run(x, outs, pool)
            return
        if self.stacked:
            from services.gpu_worker.kernels import triton_stacked_lora

            present = [i for i, seg in enumerate(self.segments) if seg is not None]
            segments, targets = [self.segments[i] for i in present], [outs[i] for i in present]
            if self.batch_invariant or all(seg.is_decode for seg in segments):
                triton_stacked_lora.stacked_mbgmv(x, pool, segments, targets, self.batch_invariant)
            else:
                triton_stacked_lora.stacked_mbgmm(x, pool, segments, targets)
            return
        if self.backend == "cpu_native":
            return  # no projection of this call has an adapter
        for seg, out in zip(self.segments, outs):
            if seg is not None:
                add_lora_delta(x, pool, seg, out, self.backend, self.batch_invariant)


def _stackable(segments: tuple[LoraSegments | None, ...]) -> bool:
    """Whether the Triton backend serves these projections with the stacked kernels (MBGMV for
    decode and batch-invariant calls, MBGMM for prefill): 2 or 3 with an adapter, over the same
    token segments."""
    present = [seg for seg in segments if seg is not None]
    return 2 <= len(present) <= 3 and share_input(present)


def add_lora_delta(
    x: torch.Tensor,
    pool: torch.Tensor,
    seg: LoraSegments,
    out: torch.Tensor,
    backend: str = "auto",
    batch_invariant: bool = False,
) -> None:
    """``out[t] += scales[s] * (x[t] @ A_s^T) @ B_s^T`` for every token of every segment with an
    adapter, in place, with ``backend`` (``auto`` or one of :data:`BACKENDS`); with
    ``batch_invariant``, each token's delta independent of the rest of the batch."""
    backend = resolve_backend(backend, pool, batch_invariant)
    if backend == "torch":
        lora_delta_torch(x, pool, seg, out)
    elif backend == "cpu_native":
        lora_delta_cpu_native(x, pool, seg, out, batch_invariant)
    elif backend == "padded_bmm":
        lora_delta_padded_bmm(x, pool, seg, out)
    elif backend == "triton":
        from services.gpu_worker.kernels import triton_lora

        if batch_invariant or seg.is_decode:
            triton_lora.mbgmv(x, pool, seg, out, batch_invariant)
        else:
            triton_lora.mbgmm(x, pool, seg, out)
    else:
        raise ValueError(f"unknown LoRA backend {backend!r}; expected 'auto' or one of {BACKENDS}")
