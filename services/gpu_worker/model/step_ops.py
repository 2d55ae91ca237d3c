"""The operations between a step's base matmuls and LoRA deltas (norms, rotary embedding and KV
writes, attention, activation), behind one small interface so that ``LlamaModel.forward`` is
written once for two implementations:

- :class:`TorchStepOps` (here): torch ops, with the native row-wise and attention kernels where the
  model runs them (``native``); every device, tensor parallelism, borrowed KV;
- ``native_step_ops.NativeStepOps``: one CPU worker's step, each op one prepared native call
  into buffers reused by every layer (the same bits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from services.gpu_worker.attention.chunked_attention import LocalQueries, attend_locally
from services.gpu_worker.attention.pool_view import PoolView
from services.gpu_worker.model import invariant_rowwise
from services.gpu_worker.model.step_batch import StepBatch

if TYPE_CHECKING:
    from services.gpu_worker.model.llama import LlamaModel

Linear = Callable[[torch.Tensor, object, torch.Tensor | None], torch.Tensor]
"""``linear(x, weight, bias)``: the step's base matmul (``BaseMatmul`` or ``InvariantMatmul``)."""


class TorchStepOps:
    """A step's ops as torch calls (and the native kernels where ``native``)."""

    def __init__(
        self,
        model: LlamaModel,
        batch: StepBatch,
        pool: PoolView,
        linear: Linear,
        native: bool,
        queries: list[LocalQueries] | None,
    ):
        self.model = model
        self.batch = batch
        self.pool = pool
        self._linear = linear
        self.native = native
        """Norms, SwiGLU and attention through the native CPU kernels (``LlamaModel.native_kernels``)."""
        self.queries = queries

    def linear(self, name: str, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight^T (+ bias)`` of the projection ``name`` (qkv, o, gate_up, down, lm_head)."""
        return self._linear(x, weight, bias)

    def split(self, fused: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
        """The parts of a fused projection's output, each contiguous (what the LoRA deltas and the
        rotation add into)."""
        return tuple(part.contiguous() for part in fused.split(sizes, dim=-1))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        model = self.model
        if self.native:
            return invariant_rowwise.rms_norm(x, weight, model.config.rms_norm_eps, model.compute_dtype)
        variance = x.float().pow(2).mean(-1, keepdim=True)
        normed = (x.float() * torch.rsqrt(variance + model.config.rms_norm_eps)).to(model.compute_dtype)
        return normed * weight.to(model.compute_dtype)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The residual add ``x += delta`` (in place: the same bits as ``x + delta``), then the
        next RMSNorm of ``x``."""
        if self.native:
            return invariant_rowwise.add_rms_norm(x, delta, weight, self.model.config.rms_norm_eps)
        x.add_(delta)
        return self.rms_norm(x, weight)

    def rotate_and_cache(
        self, qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary embedding of q and k, and the new k/v written to the pool: -> (q, k) rotated,
        [T, heads, head_dim] / [T, kv_heads, head_dim]."""
        model, batch, pool = self.model, self.batch, self.pool
        cfg = model.config
        q = model.rope.apply(q.view(-1, cfg.num_heads, cfg.head_dim), batch.positions)
        k = model.rope.apply(k.view(-1, cfg.num_kv_heads, cfg.head_dim), batch.positions)
        local_k, local_v = k.reshape(-1, model.kv_dim), v
        if batch.local_token_rows is not None:
            local_k, local_v = local_k[batch.local_token_rows], v[batch.local_token_rows]
        pool.kv_rows.index_copy_(0, batch.write_key_rows[layer], local_k.to(model.dtype))
        pool.kv_rows.index_copy_(0, batch.write_value_rows[layer], local_v.to(model.dtype))
        return q, k

    def attention(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """Attention of every new token over its request's KV blocks -> [T, heads * head_dim]."""
        if self.native:
            return attend_locally(
                q, self.queries, self.batch.positions, layer, self.pool, self.model.config.num_kv_heads
            )
        return self._sdpa(q, layer)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return invariant_rowwise.swiglu(gate, up) if self.native else F.silu(gate) * up

    def _sdpa(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """Attention through torch's SDPA over each request's gathered KV blocks."""
        model, batch, pool = self.model, self.batch, self.pool
        cfg = model.config
        out = torch.empty(q.shape[0], model.q_dim, dtype=q.dtype, device=q.device)
        # The pool as KV blocks of kv_block_tokens rows: page p = key block 2p, value block 2p + 1.
        blocks = pool.buffer.view(-1, pool.layout.kv_block_tokens * model.kv_dim)
        if batch.decode is not None:
            d = batch.decode
            requests = d.token_rows.numel()
            shape = (requests, -1, cfg.num_kv_heads, cfg.head_dim)
            keys = blocks.index_select(0, d.key_blocks[layer]).view(shape).to(q.dtype)
            values = blocks.index_select(0, d.value_blocks[layer]).view(shape).to(q.dtype)
            query = q[d.token_rows].unsqueeze(2)  # [R, heads, 1, head_dim]
            attended = F.scaled_dot_product_attention(
                query, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=d.mask, enable_gqa=True
            )
            out[d.token_rows] = attended.reshape(-1, model.q_dim)
        for span in batch.prefills:
            shape = (-1, cfg.num_kv_heads, cfg.head_dim)
            keys = blocks.index_select(0, span.key_blocks[layer]).view(shape).to(q.dtype)
            values = blocks.index_select(0, span.value_blocks[layer]).view(shape).to(q.dtype)
            query = q[span.token_start : span.token_end].transpose(0, 1).unsqueeze(0)
            attended = F.scaled_dot_product_attention(
                query,
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=span.mask,
                enable_gqa=True,
            )
            out[span.token_start : span.token_end] = attended[0].transpose(0, 1).reshape(-1, model.q_dim)
        return out
