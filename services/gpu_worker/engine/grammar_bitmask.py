"""Grammar masks applied to logits where the logits are: straight from llguidance's packed bitmask.

A constrained row's allowed tokens arrive as ``ceil(V / 32)`` int32 words (bit ``j`` of word
``w`` allows token ``32 w + j``; tokens past the words are not allowed). Unpacking them into a
``[rows, V]`` bool mask on the host and copying that every step moved 8x the bytes and a host
pass over the vocabulary per row; here the words are read on the logits' device: on CUDA by one
Triton kernel (``grammar_bitmask_triton``, imported on first use so that ``TRITON_INTERPRET=1``
set by a test still applies), elsewhere by three torch ops (each word against its 32 bit values,
the refused ones, the fill). It sits with the engine, which applies it to the executor's
logits (the engine imports no kernels package: it plans, the executor runs the model).
"""

from __future__ import annotations

import torch

BACKENDS = ("torch", "triton")
"""Explicit backends :func:`mask_logits_` accepts besides ``auto``."""

_bit_values: dict[torch.device, torch.Tensor] = {}


def mask_logits_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None, backend: str = "auto"
) -> None:
    """Set to -inf, in place, every logit a row's bitmask does not allow: row ``rows[i]`` of
    ``logits`` ``[batch, V]`` by ``bitmask[i]`` (``rows`` None: row ``i`` by ``bitmask[i]``).
    ``bitmask`` int32 ``[n, words]`` and ``rows`` on ``logits``' device. ``backend``: ``auto``
    (Triton on CUDA, else torch) or one of :data:`BACKENDS`."""
    count = logits.shape[0] if rows is None else rows.shape[0]
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != count:
        raise ValueError(
            f"bitmask must be int32 [{count}, words], got {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    if bitmask.device != logits.device or (rows is not None and rows.device != logits.device):
        raise ValueError(f"bitmask and rows must be on the logits' device ({logits.device})")
    if count == 0:
        return
    if backend == "auto":
        backend = "triton" if logits.is_cuda else "torch"
    if backend == "triton":
        from services.gpu_worker.engine import grammar_bitmask_triton

        grammar_bitmask_triton.mask_logits_(logits, bitmask, rows)
    elif backend == "torch":
        _mask_logits_torch(logits, bitmask, rows)
    else:
        raise ValueError(f"unknown bitmask backend {backend!r}; expected 'auto' or one of {BACKENDS}")


def _mask_logits_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    target = logits if rows is None else logits[rows]
    covered = min(target.shape[1], 32 * bitmask.shape[1])
    if covered < target.shape[1]:
        target[:, covered:] = float("-inf")  # tokens past the words
    refused = torch.logical_not(bitmask.unsqueeze(-1) & _bits(bitmask.device)).flatten(1)[:, :covered]
    target[:, :covered].masked_fill_(refused, float("-inf"))
    if rows is not None:
        logits[rows] = target


def _bits(device: torch.device) -> torch.Tensor:
    """int32 ``[32]``: ``1 << j`` (bit 31 is the sign bit), kept per device."""
    bits = _bit_values.get(device)
    if bits is None:
        bits = _bit_values[device] = torch.bitwise_left_shift(
            torch.ones(32, dtype=torch.int32), torch.arange(32, dtype=torch.int32)
        ).to(device)
    return bits
