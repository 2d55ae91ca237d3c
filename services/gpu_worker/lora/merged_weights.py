"""One adapter merged into a model's fused base weights, and unmerged exactly.

dLoRA's merged mode (seed 001): ``W += scale · B·A`` for each adapted (layer, projection),
written into the rows of the fused ``qkv`` / ``o`` / ``gate_up`` / ``down`` matrices, so requests
of that adapter run at base-model speed. Unmerging restores the touched rows from a pristine copy
saved the first time a projection is touched: bit-identical, where subtracting ``scale · B·A``
again would leave rounding residue. Used by the engine's merged mode and the merged-swap
benchmark system; not thread-safe (call it from the engine thread between steps).
"""

from __future__ import annotations

import torch

from services.gpu_worker.lora.host_adapter import HostAdapter, ModuleKey
from services.gpu_worker.model.llama import LlamaModel


class MergedWeights:
    """Merges one adapter at a time into a model's fused base weights and restores them exactly."""

    def __init__(self, model: LlamaModel):
        self.model = model
        self.merged: HostAdapter | None = None
        """The adapter merged now, if any."""
        self._pristine: dict[ModuleKey, torch.Tensor] = {}
        """Base rows of every projection an adapter has touched, copied before the first merge."""

    def merge(self, adapter: HostAdapter) -> None:
        if self.merged is not None:
            raise RuntimeError(f"adapter {self.merged.adapter_id} is still merged")
        for key, factors in adapter.modules.items():
            rows = self._rows(key)
            if key not in self._pristine:
                self._pristine[key] = rows.clone()
            delta = (factors.b_t.t().float() @ factors.a.float()).mul_(factors.scale)
            rows.add_(delta.to(rows.dtype))
        self.merged = adapter

    def unmerge(self) -> None:
        """Put back the base rows the merged adapter changed (bit-identical to before)."""
        if self.merged is None:
            return
        for key in self.merged.modules:
            self._rows(key).copy_(self._pristine[key])
        self.merged = None

    def _rows(self, key: ModuleKey) -> torch.Tensor:
        """The view of the fused base weight that holds projection ``key`` (out × in)."""
        index, projection = key
        layer, q, kv = self.model.layers[index], self.model.q_dim, self.model.kv_dim
        intermediate = self.model.config.intermediate_size
        weight, start, end = {
            "q_proj": (layer.qkv, 0, q),
            "k_proj": (layer.qkv, q, q + kv),
            "v_proj": (layer.qkv, q + kv, q + 2 * kv),
            "o_proj": (layer.o, 0, None),
            "gate_proj": (layer.gate_up, 0, intermediate),
            "up_proj": (layer.gate_up, intermediate, None),
            "down_proj": (layer.down, 0, None),
        }[projection]
        return weight[start:end]
