"""Build one rank's model of a tensor-parallel group from the full config and weights.

Every rank builds it the same way (``TensorParallelLayout.for_config(config, size, rank)``, a
:class:`TensorParallelContext` over the group's collectives); the executor
(``executor/tensor_parallel.py``) adds the rank's pool and step builder.
"""

from __future__ import annotations

import torch

from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.tp.context import TensorParallelContext
from services.gpu_worker.tp.sharding import shard_base_weights
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
