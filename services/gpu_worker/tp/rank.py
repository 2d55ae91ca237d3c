"""Build one rank of a tensor-parallel group: its model, its pool, its adapters.

A caller (the TP executor, the tests, the bench) does, on every rank, in the same order::

    layout = TensorParallelLayout.for_config(config, size, rank)
    ctx = TensorParallelContext(layout, TorchDistributedCollectives())
    model = build_rank_model(config, weights, ctx, dtype)
    pool = build_rank_pool(config, layout, num_pages, kv_block_tokens, dtype)  # same num_pages
    residency = AdapterResidency(pool)
    page_adapter(residency, host_adapter, layout)      # the full adapter in, its shard paged
    builder = StepBuilder(model, pool, shapes=lora_shapes(layout))   # tp_executor.lora_shapes
    logits = model.forward(builder.build(plan, residency.get), pool)   # same StepPlan on every rank
"""

from __future__ import annotations

import torch

from services.gpu_worker.attention.pool_view import PoolLayout
from services.gpu_worker.lora.host_adapter import HostAdapter
from services.gpu_worker.memory.adapter_residency import AdapterResidency, ResidentAdapter
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.tp.context import TensorParallelContext
from services.gpu_worker.tp.sharding import TensorParallelLayout, shard_adapter, shard_base_weights
from services.model_files.model_config import ModelConfig


def build_rank_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    tp: TensorParallelContext,
    dtype: torch.dtype,
    device="cpu",
    compute_dtype: torch.dtype | None = None,
) -> LlamaModel:
    """The rank's ``LlamaModel`` from the *full* config and weights (sharded here)."""
    layout = tp.layout
    return LlamaModel(
        layout.rank_config(config),
        shard_base_weights(weights, layout),
        dtype,
        device,
        compute_dtype=compute_dtype,
        tp=tp if layout.size > 1 else None,
    )


def build_rank_pool(
    config: ModelConfig,
    layout: TensorParallelLayout,
    num_pages: int,
    kv_block_tokens: int,
    dtype: torch.dtype,
    device="cpu",
) -> UnifiedPool:
    """The rank's pool: ``num_pages`` (the same on every rank) pages of its ``kv_dim``."""
    return UnifiedPool(
        PoolLayout(num_pages=num_pages, kv_block_tokens=kv_block_tokens, kv_dim=layout.kv_dim,
                   num_layers=config.num_layers),
        dtype,
        device,
    )  # fmt: skip


def page_adapter(
    residency: AdapterResidency, adapter: HostAdapter, layout: TensorParallelLayout
) -> ResidentAdapter:
    """Page the rank's shard of ``adapter`` (the full adapter; sharded here, or as is at N = 1)."""
    return residency.load(shard_adapter(adapter, layout) if layout.size > 1 else adapter)


def placement_fingerprint(resident: ResidentAdapter) -> tuple:
    """Pages and row offsets of a resident adapter: equal on every rank of a group."""
    return (
        tuple(resident.pages),
        tuple(
            (key, tuple(m.rows.a_offsets.tolist()), tuple(m.rows.b_offsets.tolist()))
            for key, m in sorted(resident.modules.items())
        ),
    )
