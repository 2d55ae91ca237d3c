"""What the model needs to run one engine step: tokens, where their KV goes, what each request
attends to, and the LoRA segments. Built by the engine from its requests' page tables.

Context is addressed by KV block: viewing the pool as blocks of ``kv_block_tokens`` rows of
``kv_dim`` elements, page ``p`` holds one layer's key block ``2p`` and value block ``2p + 1``
(see ``attention/pool_view.py``). Gathering a request's context one block at a time moves 16 rows per index
instead of one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from services.gpu_worker.kernels.dispatch import StepLora


@dataclass(frozen=True)
class DecodeGroup:
    """Requests adding one token this step, attended in one padded batch."""

    token_rows: torch.Tensor
    """int64 [R]: the request's token row in the step's flattened tokens."""
    key_blocks: torch.Tensor
    """int64 [L, R * N]: per layer, the key blocks of each request's context, request after
    request, each padded to N blocks (padding points at a real block and is masked)."""
    value_blocks: torch.Tensor
    """int64 [L, R * N]: the matching value blocks."""
    mask: torch.Tensor
    """bool [R, 1, 1, N * kv_block_tokens]: True where the key is part of the request's context."""


@dataclass(frozen=True)
class PrefillSpan:
    """One request adding several tokens (prompt, or prompt + output after a preemption)."""

    token_start: int
    """First row of its tokens in the step's flattened tokens."""
    token_end: int
    """End (exclusive) of its token rows."""
    key_blocks: torch.Tensor
    """int64 [L, N]: per layer, the key blocks of its whole context (earlier tokens + these)."""
    value_blocks: torch.Tensor
    """int64 [L, N]: the matching value blocks."""
    mask: torch.Tensor
    """bool [n, N * kv_block_tokens]: causal: new token i sees context positions ≤ its own."""


class RemoteAttention(Protocol):
    """Attention for the requests whose KV blocks are not all in this pool (DistKV-LLM)."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Store ``layer``'s KV of its requests' rows (``k`` [T, kv_heads, head_dim], ``v``
        [T, kv_dim]) where their blocks are, then fill those rows of ``out`` with attention of
        ``q`` [T, heads, head_dim] over each request's whole context."""
        ...

    def finish(self) -> None:
        """After the last layer: wait until the KV stored without waiting is where it belongs."""
        ...


@dataclass(frozen=True)
class StepBatch:
    """One step's inputs, all tensors on the pool's device."""

    token_ids: torch.Tensor
    """int64 [T]: the new tokens of every request, request after request."""
    positions: torch.Tensor
    """int64 [T]."""
    write_key_rows: torch.Tensor
    """int64 [L, T]: per layer, the pool row (in ``kv_rows``) receiving each new token's key."""
    write_value_rows: torch.Tensor
    """int64 [L, T]: the same for values."""
    decode: DecodeGroup | None
    """The requests adding one token, or None when there are none."""
    prefills: list[PrefillSpan]
    """The requests adding several tokens."""
    logits_rows: torch.Tensor
    """int64: the rows whose logits are returned: each request's last token's (the one its next
    token is sampled from) and, for a request with drafts, the rows verifying them before it."""
    lora: StepLora | None
    """Per layer, per projection name, the LoRA segments; None when no request uses an adapter."""
    lora_backend: str = "auto"
    """Kernel backend for the LoRA deltas (see ``kernels.dispatch``)."""
    batch_invariant: bool = False
    """Deterministic serving: compute every request's logits independently of the rest of the
    batch and of whether its KV came from prefill or decode (``LlamaModel``)."""
    local_token_rows: torch.Tensor | None = None
    """int64 [T_local]: the rows whose KV goes to the pool (``write_*_rows`` are then [L, T_local]);
    None: every row's."""
    remote: RemoteAttention | None = None
    """The requests with remote KV blocks, outside ``decode`` and ``prefills``; None when none."""
