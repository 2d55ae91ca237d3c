"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over the unified paged pool.

Tokens of all requests are flattened into one ``[T, hidden]`` batch, so the base model's
matmuls are shared by every request whatever its adapter; each projection then adds its LoRA
delta through the one kernel dispatch point, gathering each request's adapter rows from the
pool. Keys and values are written to, and read from, the pool's KV pages.

Weights, KV cache and adapter pages are stored in ``dtype``; activations and matmuls use
``compute_dtype`` (see ``compute_dtype``: fp32 for bf16 weights on CPUs without bf16 GEMMs).

A batch marked ``batch_invariant`` (deterministic serving) runs the base matmuls, norms,
activation, attention and LoRA deltas through kernels that compute each row alone
(``invariant_matmul``, ``invariant_rowwise``, ``chunked_attention``, the LoRA kernels' fixed
order): a request's logits are then the same bits whatever else is in its batch, and whether its
KV came from prefill or decode. Rotary embeddings, residual adds and dtype casts are elementwise
IEEE operations, the same for every position already. CPU only.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from services.gpu_worker.attention.chunked_attention import local_queries
from services.gpu_worker.attention.pool_view import PoolView
from services.gpu_worker.kernels.cpu_invariant import invariant_available, invariant_error
from services.gpu_worker.model.base_matmul import BaseMatmul
from services.gpu_worker.model.compute_dtype import resolve_compute_dtype
from services.gpu_worker.model.huge_pages import gather_in_huge_pages
from services.gpu_worker.model.invariant_matmul import InvariantMatmul
from services.gpu_worker.model.native_step_ops import NativeStepOps
from services.gpu_worker.model.quantized_weight import QuantizedWeight
from services.gpu_worker.model.rope import RotaryTable
from services.gpu_worker.model.step_batch import StepBatch
from services.gpu_worker.model.step_ops import TorchStepOps
from services.model_files.model_config import ModelConfig

# The model's LoRA calls, each on the projections that read one input.
_QKV = ("q_proj", "k_proj", "v_proj")
_O = ("o_proj",)
_GATE_UP = ("gate_proj", "up_proj")
_DOWN = ("down_proj",)


def _cat(weights: list) -> torch.Tensor | QuantizedWeight:
    """Row-concatenated weights (fused projections), quantized or not."""
    if isinstance(weights[0], QuantizedWeight):
        return QuantizedWeight.cat(weights)
    return torch.cat(weights)


def _on_device(weight, device, dtype):
    return weight if isinstance(weight, QuantizedWeight) else weight.to(device=device, dtype=dtype)


class _Layer:
    """One decoder block's weights, q/k/v and gate/up fused so the base matmuls are few."""

    def __init__(self, weights: dict[str, torch.Tensor], prefix: str, config: ModelConfig, dtype, device):
        def w(name: str) -> torch.Tensor | QuantizedWeight:
            weight = weights[f"{prefix}.{name}"]
            return weight if isinstance(weight, QuantizedWeight) else weight.to(device=device, dtype=dtype)

        self.qkv = _cat(
            [w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")]
        )
        self.qkv_bias = (
            torch.cat([w("self_attn.q_proj.bias"), w("self_attn.k_proj.bias"), w("self_attn.v_proj.bias")])
            if config.attention_bias
            else None
        )
        self.o = w("self_attn.o_proj.weight")
        self.gate_up = _cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")])
        self.down = w("mlp.down_proj.weight")
        self.input_norm = w("input_layernorm.weight")
        self.post_norm = w("post_attention_layernorm.weight")


class LlamaModel:
    """Inference-only forward pass; no autograd, no nn.Module state beyond the weights.

    ``dtype`` is the storage dtype of weights, KV cache and adapter pages; ``compute_dtype``
    (default: resolved from the device, see :func:`resolve_compute_dtype`) that of activations
    and matmuls.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device="cpu",
        compute_dtype: torch.dtype | None = None,
        tp=None,
    ):
        """``tp``: None (one device, the default) or a rank's tensor-parallel context
        (``services.gpu_worker.tp.context.TensorParallelContext``); ``config`` and ``weights``
        are then the rank's (``TensorParallelLayout.rank_config``, ``shard_base_weights``)."""
        self.config = config
        self.tp = tp
        self.dtype = dtype
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype or resolve_compute_dtype(dtype, self.device)
        self.embed = _on_device(weights["model.embed_tokens.weight"], self.device, dtype)
        self.lm_head = (
            self.embed
            if config.tie_word_embeddings or "lm_head.weight" not in weights
            else _on_device(weights["lm_head.weight"], self.device, dtype)
        )
        self.norm = weights["model.norm.weight"].to(device=self.device, dtype=dtype)
        self.layers = [
            _Layer(weights, f"model.layers.{i}", config, dtype, self.device) for i in range(config.num_layers)
        ]
        if self.device.type == "cpu":
            self._gather_weights_in_huge_pages()
        qkv = self.layers[0].qkv if self.layers else None
        self.quantization = qkv.format if isinstance(qkv, QuantizedWeight) else "none"
        """The projections' block format (``quantization.py``); ``none``: dequantized weights."""
        if self.quantization != "none" and (self.device.type != "cpu" or tp is not None):
            raise ValueError(
                f"--quantization {self.quantization} runs on one CPU worker (its kernels are CPU-only "
                "and not sharded): serve a GPU or tensor-parallel worker with --quantization none"
            )
        self.rope = RotaryTable(
            config.head_dim,
            config.rope_theta,
            config.rope_scaling,
            config.max_position_embeddings,
            self.device,
            self.compute_dtype,
        )
        self.q_dim = config.num_heads * config.head_dim
        self.kv_dim = config.num_kv_heads * config.head_dim
        widest = max(
            w.numel() for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        self.matmul = BaseMatmul(
            self.compute_dtype, widest if self.compute_dtype != dtype else 0, self.device
        )
        self.invariant_matmul = InvariantMatmul(self.compute_dtype)
        """The matmuls of batch-invariant steps."""
        self.native_kernels = (
            self.device.type == "cpu" and tp is None and config.head_dim % 8 == 0 and invariant_available()
        )
        """Attention, RMSNorm and SwiGLU of every step through the native CPU kernels
        (``cpu_invariant``), not only of batch-invariant ones: attention reads the KV pages where
        they are instead of gathering them for torch's SDPA, which halved the decode step at
        batch 32 on a 2-core EPYC (bench/HISTORY.md, "Quantized base weights and the CPU step")."""

    def _gather_weights_in_huge_pages(self) -> None:
        """Every matrix a decode step streams (the projections and the output head) in one region
        backed by huge pages (``memory/huge_pages.py``): fewer TLB misses as a step streams them."""
        slots = [(layer, name) for layer in self.layers for name in ("qkv", "o", "gate_up", "down")]
        slots.append((self, "lm_head"))
        weights = [getattr(owner, name) for owner, name in slots]
        tied = self.lm_head is self.embed
        copies = gather_in_huge_pages([w.blocks if isinstance(w, QuantizedWeight) else w for w in weights])
        for (owner, name), weight, copy in zip(slots, weights, copies):
            setattr(
                owner, name, replace(weight, blocks=copy) if isinstance(weight, QuantizedWeight) else copy
            )
        if tied:
            self.embed = self.lm_head

    def check_batch_invariant(self) -> None:
        """Raise ValueError/RuntimeError when this model cannot run batch-invariant steps."""
        if self.device.type != "cpu":
            raise ValueError(
                f"deterministic serving runs on CPU workers; this model is on {self.device} "
                "(serve it with deterministic off)"
            )
        if not invariant_available():
            raise RuntimeError(f"deterministic serving needs the native CPU kernels: {invariant_error()}")
        if self.config.head_dim % 8:
            raise ValueError(f"deterministic serving needs head_dim % 8 == 0, not {self.config.head_dim}")

    def _fused_glue(self, batch: StepBatch, native: bool) -> bool:
        """Whether this step runs :class:`NativeStepOps` (each op one prepared native call, the
        LoRA deltas added into views of the fused outputs). Tensor-parallel ranks keep
        :class:`TorchStepOps`."""
        return native and self.tp is None and self.config.head_dim % 16 == 0

    @staticmethod
    def _lora(batch: StepBatch, layer: int, names: tuple[str, ...], x: torch.Tensor, pool, *outs) -> None:
        """Add the LoRA delta of projection ``names[i]``, which reads ``x``, into ``outs[i]``."""
        if batch.lora is not None:
            batch.lora.add_deltas(
                layer, names, x, outs, pool.buffer, batch.lora_backend, batch.batch_invariant
            )

    @torch.inference_mode()
    def forward(self, batch: StepBatch, pool: PoolView) -> torch.Tensor:
        """Logits ``[R, vocab]`` (float32) of each request's last token; fills the KV cache.

        With a tensor-parallel context, the LoRA deltas go through it and o/down (row-parallel,
        partial sums) are all-reduced after their LoRA is added; every rank returns the logits.
        """
        cfg = self.config
        invariant = batch.batch_invariant
        tp = self.tp
        lora = self._lora
        if tp is not None:
            tp.check_batch(batch)
            lora = tp.lora
        if isinstance(self.embed, QuantizedWeight):
            x = self.embed.rows(batch.token_ids).to(self.compute_dtype)
        else:
            x = self.embed[batch.token_ids].to(self.compute_dtype)
        native = invariant or self.native_kernels
        linear = self.invariant_matmul.linear if invariant else self.matmul.linear
        queries = local_queries(batch) if native else None
        if self._fused_glue(batch, native):
            ops = NativeStepOps(self, batch, pool, linear, queries)
        else:
            ops = TorchStepOps(self, batch, pool, linear, native, queries)
        h = ops.rms_norm(x, self.layers[0].input_norm) if self.layers else x
        for index, layer in enumerate(self.layers):
            qkv = ops.linear("qkv", h, layer.qkv, layer.qkv_bias)
            q, k, v = ops.split(qkv, [self.q_dim, self.kv_dim, self.kv_dim])
            lora(batch, index, _QKV, h, pool, q, k, v)
            q, k = ops.rotate_and_cache(qkv, q, k, v, index)
            attn = ops.attention(q, index)
            if batch.remote is not None:
                batch.remote.attend(index, q, k, v, attn)
            o = ops.linear("o", attn, layer.o)
            lora(batch, index, _O, attn, pool, o)
            if tp is not None:
                tp.all_reduce_base(o)
            h = ops.add_rms_norm(x, o, layer.post_norm)
            gate_up = ops.linear("gate_up", h, layer.gate_up)
            gate, up = ops.split(gate_up, [cfg.intermediate_size, cfg.intermediate_size])
            lora(batch, index, _GATE_UP, h, pool, gate, up)
            act = ops.swiglu(gate, up)
            down = ops.linear("down", act, layer.down)
            lora(batch, index, _DOWN, act, pool, down)
            if tp is not None:
                tp.all_reduce_base(down)
            if index + 1 < len(self.layers):
                h = ops.add_rms_norm(x, down, self.layers[index + 1].input_norm)
            else:
                x.add_(down)
        if batch.remote is not None:
            batch.remote.finish()
        last = ops.rms_norm(x[batch.logits_rows], self.norm)
        return ops.linear("lm_head", last, self.lm_head).float()
