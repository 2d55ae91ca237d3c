"""One CPU worker's step ops as prepared native calls into buffers reused by every layer.

Between its base matmuls a decode step used to run ~25 torch ops per layer (split and copy the
fused outputs, rotate q and k, cast and scatter the new KV, the residual adds), and each native
kernel call spent ~10 µs in Python checking its tensors: at batch 1 on a 2-core EPYC that glue
was a quarter of the step (bench/HISTORY.md, "Quantized base weights and the CPU step"). Here:

- each op is one native call (``cpu_invariant``: the residual add with the next RMSNorm, rotary
  embedding with the KV writes; ``cpu_quant`` for quantized weights), checked when the step's first
  layer prepares it and then run by setting the pointers that change (the layer's weights);
- the outputs go to buffers allocated once per step, and the LoRA deltas are added into views of
  the fused qkv / gate_up outputs (no copies);
- the step's attention is one call per layer, its decode group and its spans (prompts, drafts to
  verify) merged (``merged_queries``);
- every value is computed as :class:`~services.gpu_worker.model.step_ops.TorchStepOps` computes it
  with ``native`` on: the same bits (``tests/gpu_worker/model/test_fused_glue.py``).

Used for steps without tensor parallelism where ``head_dim % 16 == 0`` (``LlamaModel.forward``
decides), borrowing requests' rows included: their rotated K/V are staged for ``batch.remote``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.gpu_worker.attention.chunked_attention import LocalQueries
from services.gpu_worker.attention.pool_view import PoolView
from services.gpu_worker.kernels import cpu_invariant, cpu_quant
from services.gpu_worker.kernels.cpu_invariant import PreparedCall
from services.gpu_worker.model.merged_queries import merged_queries
from services.gpu_worker.model.quantized_weight import QuantizedWeight
from services.gpu_worker.model.step_batch import StepBatch
from services.gpu_worker.model.step_ops import Linear, TorchStepOps

if TYPE_CHECKING:
    from services.gpu_worker.model.llama import LlamaModel


class NativeStepOps(TorchStepOps):
    """:class:`TorchStepOps`' interface (``native`` on), each op one prepared native call."""

    def __init__(
        self, model: LlamaModel, batch: StepBatch, pool: PoolView, linear: Linear, queries: list[LocalQueries]
    ):
        super().__init__(model, batch, pool, linear, True, merged_queries(queries))
        tokens, dtype = batch.token_ids.numel(), model.compute_dtype
        self._tokens = tokens
        self._norm_out = torch.empty(tokens, model.config.hidden_size, dtype=dtype)
        """Every norm's output: each is consumed (matmul, LoRA) before the next is computed."""
        self._q = torch.empty(tokens, model.q_dim, dtype=dtype)
        self._attn = torch.empty(tokens, model.q_dim, dtype=dtype)
        self._act = torch.empty(tokens, model.config.intermediate_size, dtype=dtype)
        self._outputs: dict[str, torch.Tensor] = {}
        """The quantized projections' outputs, by projection name."""
        self._calls: dict[tuple, PreparedCall] = {}
        self._views: dict[tuple[int, ...], tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}
        """Split sizes -> (the buffer split, its views)."""

    def linear(self, name: str, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(weight, QuantizedWeight) or x.shape[0] != self._tokens:
            return self._linear(x, weight, bias)
        if bias is not None:
            bias = bias.to(self.model.compute_dtype)
        key = ("linear", name, weight.format, weight.shape)
        call = self._calls.get(key)
        if call is None:
            out = self._outputs[name] = torch.empty(
                x.shape[0], weight.shape[0], dtype=self.model.compute_dtype
            )
            call = self._calls[key] = cpu_quant.prepare_linear(
                x, weight.blocks, weight.format, weight.shape[0], bias, out
            )
            call.run()
        else:
            call.run(
                x=x.data_ptr(), w=weight.blocks.data_ptr(), bias=None if bias is None else bias.data_ptr()
            )
        return self._outputs[name]

    def split(self, fused: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
        """Views: the LoRA kernels add into rows of the fused output where they are. Every layer
        splits the same output buffer the same way: its views are made once per step."""
        cached = self._views.get(tuple(sizes))
        if cached is not None and cached[0] is fused:
            return cached[1]
        views = fused.split(sizes, dim=-1)
        self._views[tuple(sizes)] = (fused, views)
        return views

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        call = self._calls.get(("add_rms_norm",))
        if call is None:
            call = self._calls[("add_rms_norm",)] = cpu_invariant.prepare_add_rms_norm(
                x, delta, weight, self.model.config.rms_norm_eps, self._norm_out
            )
            call.run()
        else:
            call.run(x=x.data_ptr(), delta=delta.data_ptr(), weight=weight.data_ptr())
        return self._norm_out

    def rotate_and_cache(
        self, qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q rotated [T, heads, head_dim]; k and v go to the cache. Returned k: unrotated when
        every row is cached; rotated when the step has borrowing requests (their rows' K/V go
        to their blocks through ``batch.remote``, not to this pool)."""
        model, batch = self.model, self.batch
        cfg = model.config
        if batch.local_token_rows is not None:
            return self._rotate_through_staging(qkv, layer)
        keys, values = batch.write_key_rows[layer], batch.write_value_rows[layer]
        call = self._calls.get(("rope_kv",))
        if call is None:
            call = self._calls[("rope_kv",)] = cpu_invariant.prepare_rope_kv(
                qkv, batch.positions, model.rope.cos, model.rope.sin, cfg.num_heads, cfg.num_kv_heads,
                self._q, self.pool.kv_rows, keys, values,
            )  # fmt: skip
            call.run()
        else:
            call.run(qkv=qkv.data_ptr(), key_rows=keys.data_ptr(), value_rows=values.data_ptr())
        return self._q.view(-1, cfg.num_heads, cfg.head_dim), k

    def _rotate_through_staging(self, qkv: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation into a staging buffer of every row's k and v (pool dtype, as the cache
        holds them), then this pool's rows copied from it: the borrowing rows read theirs there."""
        model, batch, pool = self.model, self.batch, self.pool
        cfg, tokens = model.config, self._tokens
        call = self._calls.get(("rope_kv_staged",))
        if call is None:
            self._staging = torch.empty(2 * tokens, model.kv_dim, dtype=pool.kv_rows.dtype)
            self._staging_rows = torch.arange(2 * tokens)  # held: the prepared call keeps pointers
            call = self._calls[("rope_kv_staged",)] = cpu_invariant.prepare_rope_kv(
                qkv, batch.positions, model.rope.cos, model.rope.sin, cfg.num_heads, cfg.num_kv_heads,
                self._q, self._staging, self._staging_rows[:tokens], self._staging_rows[tokens:],
            )  # fmt: skip
            call.run()
        else:
            call.run(qkv=qkv.data_ptr())
        local = batch.local_token_rows
        staged_keys, staged_values = self._staging[:tokens], self._staging[tokens:]
        pool.kv_rows.index_copy_(0, batch.write_key_rows[layer], staged_keys[local])
        pool.kv_rows.index_copy_(0, batch.write_value_rows[layer], staged_values[local])
        return self._q.view(-1, cfg.num_heads, cfg.head_dim), staged_keys.view(tokens, -1, cfg.head_dim)

    def attention(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        model = self.model
        flat = q.reshape(q.shape[0], -1)
        for index, group in enumerate(self.queries):
            tables = group.tables[layer]
            call = self._calls.get(("attention", index))
            if call is None:
                call = self._calls[("attention", index)] = cpu_invariant.prepare_attention(
                    flat, self._attn, self.pool.buffer, model.config.num_kv_heads, model.config.head_dim,
                    self.pool.layout.kv_block_tokens, group.rows, self.batch.positions, tables,
                    group.table_of_row,
                )  # fmt: skip
                call.run()
            else:
                call.run(q=flat.data_ptr(), tables=tables.data_ptr())
        return self._attn

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        call = self._calls.get(("swiglu",))
        if call is None:
            call = self._calls[("swiglu",)] = cpu_invariant.prepare_silu_mul(gate, up, self._act)
            call.run()
        else:
            call.run(gate=gate.data_ptr(), up=up.data_ptr())
        return self._act
