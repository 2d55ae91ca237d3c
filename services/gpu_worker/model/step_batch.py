"""What the model needs to run one engine step: tokens, where their KV goes, what each request
attends to, and the LoRA segments. Built by the engine from its requests' page tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.gpu_worker.kernels.lora_segments import LoraSegments


@dataclass(frozen=True)
class DecodeGroup:
    """Requests adding one token this step, attended in one padded batch."""

    token_rows: torch.Tensor
    """int64 [R]: the request's token row in the step's flattened tokens."""
    key_rows: torch.Tensor
    """int64 [R, C, L]: pool rows of the keys of each request's context (padded to C)."""
    value_rows: torch.Tensor
    """int64 [R, C, L]."""
    mask: torch.Tensor
    """bool [R, 1, 1, C]: True where the key is part of the request's context."""


@dataclass(frozen=True)
class PrefillSpan:
    """One request adding several tokens (prompt, or prompt + output after a preemption)."""

    token_start: int
    token_end: int
    key_rows: torch.Tensor
    """int64 [C, L]: pool rows of the keys of its whole context (earlier tokens + these)."""
    value_rows: torch.Tensor
    mask: torch.Tensor
    """bool [n, C]: causal: new token i sees context positions ≤ its own."""


@dataclass(frozen=True)
class StepBatch:
    token_ids: torch.Tensor
    """int64 [T]: the new tokens of every request, request after request."""
    positions: torch.Tensor
    """int64 [T]."""
    write_key_rows: torch.Tensor
    """int64 [T, L]: pool rows receiving each new token's key, per layer."""
    write_value_rows: torch.Tensor
    decode: DecodeGroup | None
    prefills: list[PrefillSpan]
    logits_rows: torch.Tensor
    """int64 [R]: the row of each request's last token (the one whose logits are sampled)."""
    lora: list[dict[str, LoraSegments]] | None
    """Per layer, per projection name; None when no request in the step uses an adapter."""
    lora_backend: str = "auto"
    """Kernel backend for the LoRA deltas (see ``kernels.dispatch``)."""
