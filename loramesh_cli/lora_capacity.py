"""vLLM's ``--max-loras`` and ``--max-cpu-loras`` on `loramesh up`: counts of adapters, which a
worker's memory settings take in MiB.

vLLM reserves room for ``--max-loras`` adapters of ``--max-lora-rank`` on the GPU and keeps up to
``--max-cpu-loras`` in host RAM. A loramesh worker has one unified pool for KV pages and adapter
pages (``--pool-mib``) and a host cache in MiB (``--host-cache-mib``), so each count becomes the
room for that many adapters of the largest rank the store accepts, at 4 bytes a weight (fp32, the
widest dtype an adapter is held in) on all seven projections of every layer: the most one such
adapter can take.
"""

from __future__ import annotations

import math

from services.model_files.base_model import load_base_model_spec
from services.model_files.model_config import BaseModelSpec

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every module a LoRA adapter of a Llama-family model can target."""
BYTES_PER_WEIGHT = 4


def adapter_mib(spec: BaseModelSpec, rank: int) -> float:
    """MiB of the largest adapter of ``rank`` over ``spec``: A (rank × in) and B (out × rank) on
    every projection of every layer."""
    per_layer = sum(sum(spec.projection_shape(module)) for module in PROJECTIONS)
    return rank * per_layer * spec.num_layers * BYTES_PER_WEIGHT / 2**20


def pool_mib(base_pool_mib: float, max_loras: int | None, model: str | None, rank: int) -> float:
    """Each worker's ``--pool-mib``: ``base_pool_mib`` and, with ``--max-loras N``, room for N
    adapters of ``rank`` beside it (whole MiB)."""
    if not max_loras:
        return base_pool_mib
    return base_pool_mib + math.ceil(max_loras * adapter_mib(load_base_model_spec(model), rank))


def host_cache_mib(max_cpu_loras: int, model: str | None, rank: int) -> int:
    """Each worker's ``--host-cache-mib`` for ``--max-cpu-loras N``: room for N adapters of
    ``rank`` (whole MiB)."""
    return math.ceil(max_cpu_loras * adapter_mib(load_base_model_spec(model), rank))
